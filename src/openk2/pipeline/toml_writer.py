"""Write a parsed TOML document back out, so each pipeline stage leaves the exact run file it ran with.

Covers what run files hold: tables, arrays of tables (`[[data.sources]]`), strings, numbers, booleans and
arrays. `None` has no TOML form; keys holding it are left out (every run-file key defaulting to None means
"unset"). `tomllib.loads(dumps(doc)) == doc` for such documents (tested).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def dumps(document: dict[str, Any]) -> str:
    lines: list[str] = []
    _write_table(lines, [], document)
    return "\n".join(lines).strip() + "\n"


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _write_table(lines: list[str], path: list[str], table: dict[str, Any]) -> None:
    plain = {k: v for k, v in table.items() if v is not None and not isinstance(v, dict) and not _is_table_array(v)}
    if path and (plain or not table):
        lines += ["", f"[{'.'.join(_key(p) for p in path)}]"]
    lines += [f"{_key(k)} = {_value(v)}" for k, v in plain.items()]
    for k, v in table.items():
        if isinstance(v, dict):
            _write_table(lines, [*path, k], v)
        elif _is_table_array(v):
            for item in v:
                lines += ["", f"[[{'.'.join(_key(p) for p in [*path, k])}]]"]
                lines += [f"{_key(ik)} = {_value(iv)}" for ik, iv in item.items() if iv is not None]


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes (\" \\ \n \uXXXX) are all valid in TOML basic strings
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise ValueError(f"cannot write {type(value).__name__} value {value!r} as TOML")


__all__ = ["dumps"]
