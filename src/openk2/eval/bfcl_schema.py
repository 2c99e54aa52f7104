"""BFCL's data files, and its function docs turned into OpenAI tools.

The Berkeley Function Calling Leaderboard ships inside the `bfcl-eval` package (nothing is downloaded):
`data/BFCL_v4_<category>.json` holds the questions and function docs, one JSON object per line, and
`data/possible_answer/BFCL_v4_<category>.json` the gold calls; multi-turn entries name backend classes whose
docs live in `data/multi_turn_func_doc/`.

A BFCL function doc is almost an OpenAI tool, with its own type names (`dict`, `float`, `tuple`, `any`) and
names that may contain dots, which OpenAI-style APIs refuse. `tools_for(docs)` converts a list of docs into
tools whose `parameters` are valid JSON Schema (Draft 2020-12) and returns the map from each tool name back to
the BFCL name, so scoring always happens in BFCL's names. As BFCL's function-calling runner does, every
description ends with "Note that the provided function is in Python 3 syntax." and every float property's
with "This is a float type value." (with `format: float`).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

# BFCL type -> JSON Schema type; None means "no constraint" (BFCL's `any`).
_TYPES: dict[str, str | None] = {
    "dict": "object", "object": "object", "float": "number", "number": "number", "integer": "integer",
    "string": "string", "boolean": "boolean", "array": "array", "tuple": "array", "any": None,
}
# Keywords carried over unchanged; BFCL-only ones (`optional`, a boolean `required`) are dropped.
_KEPT = ("description", "enum", "default", "format", "minimum", "maximum", "minItems", "maxItems")
# The hints BFCL's runner appends (`_get_language_specific_hint`, `_cast_to_openai_type`).
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."
FLOAT_HINT = " This is a float type value."
# OpenAI's rule for function names.
_LEGAL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def bfcl_data_dir() -> Path:
    """The `data/` folder of the installed `bfcl-eval` package."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("BFCL needs the `bfcl-eval` package (pip install bfcl-eval); it is not installed")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    if not data.is_dir():
        raise ValueError(f"the installed bfcl-eval has no data folder at {data}")
    return data


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def tool_name(name: str) -> str:
    """`name` made legal for OpenAI-style APIs: every character outside [A-Za-z0-9_-] becomes '_'."""
    legal = re.sub(r"[^A-Za-z0-9_-]", "_", name)
    if not _LEGAL_NAME.fullmatch(legal):
        raise ValueError(f"function name {name!r} cannot be made a legal tool name (1-64 characters)")
    return legal


def to_json_schema(schema: dict[str, Any], is_property: bool = False) -> dict[str, Any]:
    """One BFCL parameter schema (and everything nested in it) as JSON Schema; a float property gets BFCL's
    float hint."""
    out: dict[str, Any] = {}
    bfcl_type = schema.get("type")
    if bfcl_type is not None:
        if bfcl_type not in _TYPES:
            raise ValueError(f"unknown BFCL type {bfcl_type!r}; known: {', '.join(_TYPES)}")
        if _TYPES[bfcl_type] is not None:
            out["type"] = _TYPES[bfcl_type]
    for key in _KEPT:
        if key in schema:
            out[key] = schema[key]
    if is_property and bfcl_type == "float":
        out["description"] = str(out.get("description", "")) + FLOAT_HINT
        out["format"] = "float"
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {k: to_json_schema(v, is_property=True) for k, v in schema["properties"].items()}
    if isinstance(schema.get("required"), list):
        out["required"] = list(schema["required"])
    if isinstance(schema.get("items"), dict):
        out["items"] = to_json_schema(schema["items"])
    return out


def to_tool(doc: dict[str, Any]) -> dict[str, Any]:
    """One BFCL function doc as an OpenAI tool (`{"type": "function", "function": {...}}`)."""
    parameters = to_json_schema(doc.get("parameters") or {"type": "dict", "properties": {}})
    parameters["type"] = "object"  # the top level is always an object, whatever BFCL wrote
    parameters.setdefault("properties", {})
    return {"type": "function", "function": {"name": tool_name(doc["name"]),
                                             "description": doc.get("description", "") + PYTHON_HINT,
                                             "parameters": parameters}}


def tools_for(docs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The tools for `docs` and the map tool name -> BFCL name (which also maps every BFCL name to itself,
    so a model that echoes the dotted name is understood too)."""
    tools, names = [], {}
    for doc in docs:
        tool = to_tool(doc)
        legal = tool["function"]["name"]
        if names.get(legal, doc["name"]) != doc["name"]:
            raise ValueError(f"functions {names[legal]!r} and {doc['name']!r} both become tool {legal!r}")
        names[legal] = doc["name"]
        tools.append(tool)
    for doc in docs:
        names.setdefault(doc["name"], doc["name"])
    return tools, names
