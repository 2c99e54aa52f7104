"""Grammars for constrained decoding in K2's wire format, as Lark text (llguidance's dialect; no torch here).

What a grammar covers is what the model still has to write after the prompt (and any forced prefix):

    tool_choice "required"   prefix <|tool_calls_section_begin|><|tool_call_begin|>functions.
                             grammar NAME ":" IDX <|tool_call_argument_begin|> ARGS <|tool_call_end|>  (1 to 4 calls)
                                     (<|tool_call_begin|> "functions." NAME ":" IDX ... <|tool_call_end|>)*
                                     <|tool_calls_section_end|> <|im_end|>
    tool_choice {name}       prefix ...functions.NAME:0<|tool_call_argument_begin|>
                             grammar ARGS(name) <|tool_call_end|> <|tool_calls_section_end|> <|im_end|>
    strict "auto"            free text until the model writes <|tool_calls_section_begin|>; from there the
                             `section_calls` grammar: one or more calls, the section end, <|im_end|>
    response_format json     grammar JSON(schema) <|im_end|>

ARGS(name) is the JSON of the declared tool's `parameters` schema (llguidance's `%json`), so a finished call
always names a declared tool and its arguments validate. `<|...|>` are single special tokens, never text.
Whitespace inside JSON is not flexible (compact, one space after separators allowed by the schema compiler).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from openk2.chat.tool_parsers.kimi_k2 import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    CALL_ID_PREFIX,
    IM_END,
    SECTION_BEGIN,
    SECTION_END,
)

_JSON_OPTIONS = {"whitespace_flexible": False}
MAX_PARALLEL_CALLS = 4  # calls one constrained reply may hold (1 with parallel_tool_calls=false)
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tighten(schema: Any, max_string_length: int | None = None) -> Any:
    """A copy of a JSON schema for generation: objects that list properties allow no others unless they say so
    (as xgrammar's strict mode), and with `max_string_length` free strings get that maxLength (so a model that
    rambles still closes its strings; what validates is unchanged otherwise)."""
    if isinstance(schema, list):
        return [tighten(s, max_string_length) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples") else tighten(v, max_string_length))
           for k, v in schema.items()}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: tighten(v, max_string_length) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    free_string = out.get("type") == "string" and not ({"enum", "const", "pattern", "format"} & out.keys())
    if max_string_length is not None and free_string and "maxLength" not in out:
        out["maxLength"] = max_string_length
    return out


# Validation keywords a grammar cannot express (llguidance rejects a schema using them). Generation drops them
# rather than the whole schema: the rest still holds, and a client validating the full schema rarely fails.
UNENFORCEABLE_KEYWORDS = ("uniqueItems",)


def without_keywords(schema: Any, keywords: Sequence[str] = UNENFORCEABLE_KEYWORDS) -> Any:
    """A copy of a JSON schema without `keywords` anywhere in it (property names are names, not keywords)."""
    if isinstance(schema, list):
        return [without_keywords(s, keywords) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in keywords:
            continue
        if key in ("enum", "const", "default", "examples"):
            out[key] = value
        elif key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: without_keywords(sub, keywords) for name, sub in value.items()}
        else:
            out[key] = without_keywords(value, keywords)
    return out


def tool_schema(tool: dict) -> dict:
    """A declared tool's argument schema (an object schema when it declares none)."""
    params = tool.get("function", {}).get("parameters")
    return params if isinstance(params, dict) and params else dict(ANY_OBJECT)


def tool_name(tool: dict) -> str:
    """A declared tool's function name."""
    name = tool.get("function", {}).get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("every tool needs a function name")
    return name


def _json_rule(schema: dict) -> str:
    body = dict(schema)
    body["x-guidance"] = dict(_JSON_OPTIONS, **body.get("x-guidance", {}))
    return "%json " + json.dumps(body, sort_keys=True)


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal (JSON escapes are valid Lark escapes)


def _call_rules(tools: Sequence[dict], schemas: dict[str, dict]) -> list[str]:
    """`head: tail_0 | tail_1 ...` where tail_i = "NAME_i:" IDX <arg_begin> ARGS_i <call_end>."""
    rules, tails = [], []
    for i, tool in enumerate(tools):
        name = tool_name(tool)
        rules.append(f"tail_{i}: {_lit(name + ':')} IDX {ARGUMENT_BEGIN} args_{i} {CALL_END}")
        rules.append(f"args_{i}: {_json_rule(schemas.get(name, tool_schema(tool)))}")
        tails.append(f"tail_{i}")
    rules.append("head: " + " | ".join(tails))
    rules.append(f"call: {CALL_BEGIN} {_lit(CALL_ID_PREFIX)} head")
    rules.append("IDX: /[0-9]{1,3}/")
    return rules


def _at_most(rule: str, n: int) -> str:
    """Lark for 0..n repetitions of `rule` (nested optionals: llguidance's Lark has no bounded repeat)."""
    out = ""
    for _ in range(n):
        out = f"({rule} {out})?" if out else f"{rule}?"
    return out


def required_calls(tools: Sequence[dict], schemas: dict[str, dict] | None = None,
                   max_calls: int = MAX_PARALLEL_CALLS) -> str:
    """After the forced `...<|tool_call_begin|>functions.`: 1..max_calls calls to declared tools, the ends."""
    rules = [f"start: head {_at_most('call', max_calls - 1)} {SECTION_END} {IM_END}"]
    return "\n".join(rules + _call_rules(tools, schemas or {})) + "\n"


def named_call(tools: Sequence[dict], name: str, schemas: dict[str, dict] | None = None) -> str:
    """After the forced header of call 0 to `name`: its arguments, then the call, section and turn ends."""
    tool = next((t for t in tools if tool_name(t) == name), None)
    if tool is None:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    schema = (schemas or {}).get(name, tool_schema(tool))
    return f"start: args {CALL_END} {SECTION_END} {IM_END}\nargs: {_json_rule(schema)}\n"


def section_calls(tools: Sequence[dict], schemas: dict[str, dict] | None = None,
                  max_calls: int = MAX_PARALLEL_CALLS) -> str:
    """After the model opened a call section itself (strict `auto`): 1..max_calls calls, then the ends."""
    rules = [f"start: call {_at_most('call', max_calls - 1)} {SECTION_END} {IM_END}"]
    return "\n".join(rules + _call_rules(tools, schemas or {})) + "\n"


def json_reply(schema: dict | None) -> str:
    """A reply that is one JSON value of `schema` (any JSON object when None), then the turn's end."""
    return f"start: value {IM_END}\nvalue: {_json_rule(schema or ANY_OBJECT)}\n"


TRIGGER = SECTION_BEGIN  # the token that switches strict `auto` from free text to `section_calls`


def response_schema(response_format: dict | None) -> tuple[bool, dict | None]:
    """(constrained, schema) of an OpenAI `response_format`: text -> (False, None), json_object -> (True, None),
    json_schema -> (True, its schema); ValueError for anything else."""
    if not response_format or response_format.get("type", "text") == "text":
        return False, None
    kind = response_format.get("type")
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            schema = dict(ANY_OBJECT) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return True, schema
    raise ValueError(f"unknown response_format type {kind!r}; expected 'text', 'json_object' or 'json_schema'")


def reply_grammar(tools: Sequence[dict] | None, tool_choice: str | dict | None, response_format: dict | None,
                  strict_auto: bool, schemas: dict[str, dict],
                  parallel_tool_calls: bool | None = None) -> tuple[str, str | None] | None:
    """(Lark grammar, trigger marker or None) for what the reply must follow, or None when it is free.
    `schemas` holds each tool's generation schema by name (see `tighten`)."""
    constrained, schema = response_schema(response_format)
    calls = 1 if parallel_tool_calls is False else MAX_PARALLEL_CALLS
    if tools and tool_choice == "required":
        return required_calls(tools, schemas, calls), None
    if tools and isinstance(tool_choice, dict):
        return named_call(tools, tool_choice["function"]["name"], schemas), None
    if constrained:
        return json_reply(schema), None
    if tools and strict_auto and tool_choice in (None, "auto"):
        return section_calls(tools, schemas, calls), TRIGGER
    return None
