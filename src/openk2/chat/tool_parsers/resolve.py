"""Which declared tool a call means when its id names none: the request's tools and a small JSON-schema fit.

A model sometimes writes a call whose id is not `functions.NAME:IDX`: a bare counter (`0`), a client-style
id it copied from the history (`call_3`, `toolu_01...`), or garbage (`weird@id`). The arguments are fine;
only the name is missing. vLLM and SGLang resolve such a call from the request's tools: the only declared
tool, or else the one tool whose parameters the arguments fit. No tools, no fit, or several fits drop the
call: a guess would hand the client an executable call to a tool the model did not choose.

"Fit" checks the part of JSON Schema that tells tools apart, and nothing more:

- the arguments are a JSON object holding every `required` key;
- every key is declared in `properties` (of the schema or of its `anyOf`/`oneOf`/`allOf` branches), unless
  the schema gives `additionalProperties` (then extra values must fit it; `true` admits any);
- declared values fit their schema's `type`, `enum`, `const`, `anyOf`/`oneOf`/`allOf`, arrays by `items`,
  objects by `properties`/`required`/`additionalProperties` (standard defaults below the top level);
- other keywords (`pattern`, bounds, `format`, `$ref`, ...) are not checked: they admit.

A boolean schema admits everything (`true`) or nothing (`false`); at the top level `true` admits only `{}`,
since it declares no key.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from openk2.chat.tool_parsers.arguments import load_arguments


@dataclass(frozen=True)
class DeclaredTool:
    """One tool of the request: its function name and `parameters` JSON schema."""

    name: str
    parameters: Any


def declared_tools(tools: Sequence[Any] | None) -> tuple[DeclaredTool, ...]:
    """The request's OpenAI tool specs as `DeclaredTool`s (specs without a string name are skipped)."""
    out: dict[str, DeclaredTool] = {}
    for tool in tools or ():
        if isinstance(tool, DeclaredTool):
            out.setdefault(tool.name, tool)
            continue
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str) and name:
            out.setdefault(name, DeclaredTool(name, fn.get("parameters", {})))  # first declaration wins
    return tuple(out.values())


def infer_tool(tools: Sequence[DeclaredTool], arguments: str) -> tuple[str | None, str]:
    """The declared tool a call with these `arguments` means, or (None, why none can be picked)."""
    if not tools:
        return None, "no tools were declared"
    if len(tools) == 1:
        return tools[0].name, ""  # unambiguous; whether the arguments are right is the client's call
    value, error = load_arguments(arguments)
    if error is not None:
        return None, "its arguments are not valid JSON"
    fitting = [t.name for t in tools if fits_arguments(t.parameters, value)]
    if len(fitting) == 1:
        return fitting[0], ""
    if not fitting:
        return None, "its arguments fit none of the declared tools"
    return None, f"its arguments fit several declared tools ({', '.join(fitting)})"


def fits_arguments(schema: Any, value: Any) -> bool:
    """Whether `value` fits a tool's `parameters` schema, undeclared keys refused (see the module docstring)."""
    if not isinstance(value, dict):
        return False
    if isinstance(schema, bool):
        return schema and not value
    if not isinstance(schema, dict) or not fits(schema, value):
        return False
    if "additionalProperties" in schema:
        return True  # fits() has already checked the extra keys against it
    return set(value) <= _declared_keys(schema)


def _declared_keys(schema: dict) -> set[str]:
    """Property names a schema declares, its combinator branches included."""
    keys = set(schema.get("properties") or {}) if isinstance(schema.get("properties"), dict) else set()
    for combinator in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(combinator) or ():
            if isinstance(branch, dict):
                keys |= _declared_keys(branch)
    return keys


_TYPES = {
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
    or (isinstance(v, float) and math.isfinite(v) and v.is_integer()),
}


def fits(schema: Any, value: Any) -> bool:
    """Whether `value` fits `schema`, over the keywords the module docstring lists (others admit)."""
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        return True  # not a schema: nothing to check
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not any(_TYPES.get(k, lambda v: True)(value) for k in kinds if isinstance(k, str)):
            return False
    if "const" in schema and not _same(schema["const"], value):
        return False
    if isinstance(schema.get("enum"), list) and not any(_same(e, value) for e in schema["enum"]):
        return False
    branches = {c: [b for b in schema.get(c) or () if isinstance(b, dict | bool)] for c in ("anyOf", "oneOf", "allOf")}
    if branches["anyOf"] and not any(fits(b, value) for b in branches["anyOf"]):
        return False
    if branches["oneOf"] and sum(fits(b, value) for b in branches["oneOf"]) != 1:
        return False
    if not all(fits(b, value) for b in branches["allOf"]):
        return False
    if isinstance(value, dict):
        return _fits_object(schema, value)
    if isinstance(value, list) and "items" in schema and not isinstance(schema["items"], list):
        return all(fits(schema["items"], item) for item in value)
    return True


def _fits_object(schema: dict, value: dict) -> bool:
    """`properties`, `required` and `additionalProperties` of one object schema."""
    required = schema.get("required")
    if isinstance(required, list) and not all(k in value for k in required if isinstance(k, str)):
        return False
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in properties:
            if not fits(properties[key], item):
                return False
        elif not fits(extra, item):
            return False
    return True


def _same(a: Any, b: Any) -> bool:
    """JSON equality: `true` is not `1`, `1` is `1.0`."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b
