"""Seeded random JSON schemas for structured-output tests: nested objects, arrays, enums, optional fields."""

from __future__ import annotations

import random
from typing import Any

from openk2.agentic.schema import value_problems

_SCALARS = ("string", "integer", "number", "boolean")


def random_schema(rng: random.Random, depth: int = 0, max_depth: int = 2) -> dict[str, Any]:
    """An object schema of 1-3 properties (some optional), each a scalar, an enum, an array or a nested object."""
    props: dict[str, Any] = {}
    for k in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.2 and depth < max_depth:
            sub = random_schema(rng, depth + 1, max_depth)
        elif roll < 0.4:
            sub = {"type": "array", "items": random_scalar(rng), "maxItems": rng.randint(1, 3)}
        elif roll < 0.55:
            colours = ["red", "green", "blue", "ultra violet", "x"]
            sub = {"type": "string", "enum": rng.sample(colours, rng.randint(1, 3))}
        else:
            sub = random_scalar(rng)
        props[f"{rng.choice(['id', 'name', 'size', 'note', 'flag', 'when'])}_{depth}{k}"] = sub
    required = [name for name in props if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required}


def random_scalar(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(_SCALARS)
    out: dict[str, Any] = {"type": kind}
    if kind == "string":
        out["maxLength"] = rng.randint(3, 12)
    if kind == "integer" and rng.random() < 0.5:
        out.update(minimum=0, maximum=rng.randint(1, 1000))
    return out


def schema_errors(value: Any, schema: dict) -> list[str]:
    """Problems of `value` under `schema`: the pipeline's validator plus unknown keys and string lengths."""
    problems = value_problems(value, schema, "reply")
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        problems += [f"unknown key {k}" for k in value if k not in schema["properties"]]
        for key, sub in schema["properties"].items():
            if key in value:
                problems += schema_errors(value[key], sub)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            problems.append("too many items")
        for item in value:
            problems += schema_errors(item, schema["items"])
    if isinstance(value, str) and "maxLength" in schema and len(value) > schema["maxLength"]:
        problems.append(f"string longer than {schema['maxLength']}")
    return problems
