"""BFCL's own checkers (`bfcl-eval`'s `ast_checker` and `multi_turn_checker`), importable offline and safe to run.

BFCL's checker modules import `bfcl_eval.constants.model_config`, which imports every model handler and so every
vendor SDK (anthropic, cohere, mistralai, google-genai, qwen-agent, boto3, ...). The checkers read one field
from it: `MODEL_CONFIG_MAPPING[model].underscore_to_dot`, whether the model was offered function names with '.'
turned into '_' (true for OpenAI-style APIs, which is how openk2 offers them). When the real module cannot be
imported, `_ensure_model_config` puts a minimal stand-in module in its place holding one entry, `openk2-FC`;
when it can, the same entry is added to the real mapping. Nothing else of BFCL is replaced.

Decoding follows BFCL's OpenAI function-calling handler (`OpenAICompletionsHandler.decode_ast` /
`decode_execute`): each tool call's `arguments` go through `json.loads` under the name the model used, and a
reply without tool calls does not decode. A multi-turn call becomes BFCL's execution string
`name(k=repr(v), ...)`, which BFCL evaluates with Python's `eval`. Model output is hostile, so a call is passed on
only when its name is a public method of the entry's backend classes (what BFCL resolves to an instance) and its
argument names are identifiers; any other call is replaced by a call to an undefined name, which BFCL's `eval`
turns into an "Error during execution" result, as it would have for the original (which could otherwise name
`open`, `exec` or a keyword injection). BFCL keeps backend instances in module globals keyed by model name and
entry id; every check here uses a fresh model name and removes its instances afterwards, so checks are
repeatable and may run in threads.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import json
import keyword
import sys
import types
import uuid
from dataclasses import dataclass
from typing import Any

MODEL_NAME = "openk2-FC"  # the name our checks run under (no '_': BFCL maps '_' to '/' when it looks names up)
_UNSAFE_CALL = "openk2_unresolvable_call()"  # an undefined name: BFCL's eval returns an error result for it


@dataclass(frozen=True)
class _ModelConfig:
    """The one field of BFCL's ModelConfig that its checkers read."""

    underscore_to_dot: bool = True
    is_fc_model: bool = True


def _ensure_model_config() -> None:
    name = "bfcl_eval.constants.model_config"
    try:
        module = importlib.import_module(name)
    except ImportError:  # a vendor SDK the handlers import is missing: stand in for the module
        module = types.ModuleType(name)
        module.__doc__ = "openk2's stand-in: the handler registry is not needed to check answers"
        module.MODEL_CONFIG_MAPPING = {}
        sys.modules[name] = module
    module.MODEL_CONFIG_MAPPING.setdefault(MODEL_NAME, _ModelConfig())


def _ast_module() -> Any:
    _ensure_model_config()
    return importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")


def _multi_turn_modules() -> tuple[Any, Any]:
    checker = importlib.import_module("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker")
    utils = importlib.import_module("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils")
    return checker, utils


def bfcl_version() -> str:
    """The installed bfcl-eval version (recorded with the scores)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bfcl-eval")
    except PackageNotFoundError:
        return "unknown"


class DecodeError(ValueError):
    """The reply does not decode as function calls (BFCL: `ast_decoder:decoder_failed`)."""


def decode_calls(tool_calls: list[dict]) -> list[dict[str, Any]]:
    """OpenAI tool calls -> BFCL's decoded form `[{name: arguments}, ...]`, as BFCL's OpenAI FC handler decodes
    them (names as sent, arguments through `json.loads`); DecodeError when there is no call or one is malformed."""
    if not tool_calls:
        raise DecodeError("the reply has no tool calls")
    decoded = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise DecodeError("a tool call has no function name")
        raw = fn.get("arguments")
        try:
            args = json.loads(raw) if isinstance(raw, str) else copy.deepcopy(raw)
        except json.JSONDecodeError as exc:
            raise DecodeError(f"arguments of {fn['name']!r} are not JSON ({exc})") from exc
        decoded.append({fn["name"]: args})
    return decoded


def _is_call_format(decoded: list) -> bool:
    """BFCL's `is_function_calling_format_output`: a list of one-key dicts whose values are dicts."""
    return all(isinstance(d, dict) and len(d) == 1 and isinstance(next(iter(d.values())), dict) for d in decoded)


def ast_check(functions: list[dict], tool_calls: list[dict], possible_answer: list[dict],
              category: str) -> dict[str, Any]:
    """BFCL's verdict on one AST-checked single-turn reply: {"valid", "error_type", "error"} (BFCL's own keys)."""
    try:
        decoded = decode_calls(tool_calls)
    except DecodeError as exc:
        return {"valid": False, "error_type": "ast_decoder:decoder_failed", "error": [str(exc)]}
    if not _is_call_format(decoded):
        return {"valid": False, "error_type": "ast_decoder:decoder_wrong_output_format",
                "error": ["the decoded calls are not {name: {argument: value}} dicts"]}
    ast = _ast_module()
    from bfcl_eval.constants.enums import Language

    result = ast.ast_checker(copy.deepcopy(functions), decoded, copy.deepcopy(possible_answer), Language.PYTHON,
                             category, MODEL_NAME)
    if result["valid"]:
        return {"valid": True, "error_type": None, "error": None}
    return {"valid": False, "error_type": result.get("error_type"), "error": result.get("error")}


def relevance_check(tool_calls: list[dict], category: str) -> dict[str, Any]:
    """BFCL's verdict on an irrelevance (no call wanted) or relevance (a call wanted) reply: a reply "contains a
    call" when it decodes and is not empty in BFCL's sense (`is_empty_output`)."""
    try:
        decoded = decode_calls(tool_calls)
        contains_call = _is_call_format(decoded) and len(decoded) > 0
    except DecodeError:
        contains_call = False
    if "irrelevance" in category:
        return ({"valid": True, "error_type": None, "error": None} if not contains_call else
                {"valid": False, "error_type": "irrelevance_error:decoder_success",
                 "error": ["the reply decodes as a function call where none fits"]})
    return ({"valid": True, "error_type": None, "error": None} if contains_call else
            {"valid": False, "error_type": "relevance_error:decoder_failed", "error": ["no function call decoded"]})


def execution_strings(tool_calls: list[dict]) -> list[str] | None:
    """One step's tool calls as BFCL's execution strings (`convert_to_function_call`), or None when the step does
    not decode (BFCL then skips the step). Values are reprs of JSON values; names are checked by `safe_calls`."""
    try:
        decoded = decode_calls(tool_calls)
    except DecodeError:
        return None
    out = []
    for item in decoded:
        (name, args), = item.items()
        if not isinstance(args, dict):
            return None  # BFCL's `.items()` on a non-dict raises: the step is skipped
        out.append(f"{name}({','.join(f'{k}={v!r}' for k, v in args.items())})")
    return out


def _public_methods(involved_classes: list[str]) -> set[str]:
    """The names BFCL maps to an instance: public methods of the involved backend classes."""
    return set().union(*(_class_methods(name) for name in involved_classes))


@functools.cache
def _class_methods(class_name: str) -> frozenset[str]:
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

    instance = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)()
    return frozenset(n for n, _ in inspect.getmembers(instance, inspect.ismethod) if not n.startswith("_"))


def safe_calls(tool_calls: list[dict], allowed: set[str]) -> list[str] | None:
    """`execution_strings`, with every call that BFCL would not resolve to a backend method replaced by a call
    that fails harmlessly (see the module docstring)."""
    strings = execution_strings(tool_calls)
    if strings is None:
        return None
    decoded = decode_calls(tool_calls)
    safe = []
    for text, item in zip(strings, decoded, strict=True):
        (name, args), = item.items()
        ok = name in allowed and all(isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k)
                                     for k in args)
        safe.append(text if ok else _UNSAFE_CALL)
    return safe


def multi_turn_check(turn_steps: list[list[list[dict]]], entry: dict, ground_truth: list[list[str]],
                     force_terminated: bool = False) -> dict[str, Any]:
    """BFCL's verdict on one multi-turn entry. `turn_steps[t][s]` holds the tool calls of step s of turn t (an
    empty list for a text reply); `entry` needs `id`, `initial_config` and `involved_classes`. An entry cut off by
    the step limit fails as in BFCL (`multi_turn:force_terminated`)."""
    if force_terminated or len(turn_steps) != len(ground_truth):
        return {"valid": False, "error_type": "multi_turn:force_terminated",
                "error": f"{len(turn_steps)} turn(s) answered, {len(ground_truth)} expected"}
    allowed = _public_methods(entry["involved_classes"])
    decoded_turns: list[list[list[str]]] = []
    for steps in turn_steps:
        turn: list[list[str]] = []
        for calls in steps:
            strings = safe_calls(calls, allowed)
            if strings:  # BFCL skips steps that fail to decode or decode to nothing
                turn.append(strings)
        decoded_turns.append(turn)
    checker, utils = _multi_turn_modules()
    model_name = f"openk2{uuid.uuid4().hex}"
    test_entry = {"id": entry["id"], "initial_config": copy.deepcopy(entry["initial_config"]),
                  "involved_classes": list(entry["involved_classes"])}
    try:
        result = checker.multi_turn_checker(decoded_turns, copy.deepcopy(ground_truth), test_entry,
                                            entry["id"].rsplit("_", 1)[0], model_name)
    finally:
        for key in [k for k in list(vars(utils)) if k.startswith(model_name)]:
            vars(utils).pop(key, None)
    if result["valid"]:
        return {"valid": True, "error_type": None, "error": None}
    return {"valid": False, "error_type": result.get("error_type"), "error": result.get("error_message")}
