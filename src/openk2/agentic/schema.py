"""The JSON-Schema subset tool specs use: checking a schema is well-formed, checking a value against one.

Tool parameters and return values in the repository are described with `type` (object, array, string,
integer, number, boolean, null, or a list of these), `properties`, `required`, `items`, `enum`,
`additionalProperties: false`, `minimum`/`maximum` and `description`. Anything else (`$ref`, `anyOf`,
`format`, ...) is accepted in a schema but not enforced on values, so real MCP schemas pass through unchanged.
Both checks return a list of human-readable problems; empty means fine.
"""

from __future__ import annotations

from typing import Any

JSON_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")


def _type_ok(value: Any, name: str) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    return True  # unknown type names are not enforced


def schema_problems(schema: Any, where: str = "schema", require_descriptions: bool = False) -> list[str]:
    """Problems with `schema` itself: unknown types, `required` naming missing properties, untyped properties."""
    if not isinstance(schema, dict):
        return [f"{where} must be an object, got {type(schema).__name__}"]
    problems: list[str] = []
    types = schema.get("type")
    names = types if isinstance(types, list) else [types] if types is not None else []
    for t in names:
        if t not in JSON_TYPES:
            problems.append(f"{where}.type {t!r} is not a JSON type ({', '.join(JSON_TYPES)})")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            problems.append(f"{where}.properties must be an object")
            props = {}
        for key, sub in props.items():
            if isinstance(sub, dict) and "type" not in sub and not {"$ref", "anyOf", "oneOf", "enum"} & set(sub):
                problems.append(f"{where}.properties.{key} has no type")
            if require_descriptions and isinstance(sub, dict) and not str(sub.get("description", "")).strip():
                problems.append(f"{where}.properties.{key} has no description")
            problems += schema_problems(sub, f"{where}.properties.{key}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        problems.append(f"{where}.required must be a list of property names")
    else:
        missing = [r for r in required if r not in (props or {})]
        if missing:
            problems.append(f"{where}.required names undefined properties: {', '.join(missing)}")
    if "items" in schema:
        problems += schema_problems(schema["items"], f"{where}.items")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        problems.append(f"{where}.enum must be a non-empty list")
    return problems


def value_problems(value: Any, schema: Any, where: str = "arguments") -> list[str]:
    """Problems with `value` under `schema` (the subset in the module docstring)."""
    if not isinstance(schema, dict):
        return []
    types = schema.get("type")
    names = types if isinstance(types, list) else [types] if types is not None else []
    if names and not any(_type_ok(value, t) for t in names):
        return [f"{where} must be {' or '.join(names)}, got {type(value).__name__}"]
    problems: list[str] = []
    if "enum" in schema and isinstance(schema["enum"], list) and value not in schema["enum"]:
        problems.append(f"{where} must be one of {schema['enum']}, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(schema.get("minimum"), (int, float)) and value < schema["minimum"]:
            problems.append(f"{where} must be >= {schema['minimum']}, got {value}")
        if isinstance(schema.get("maximum"), (int, float)) and value > schema["maximum"]:
            problems.append(f"{where} must be <= {schema['maximum']}, got {value}")
    if isinstance(value, dict):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        for key in schema.get("required", []) if isinstance(schema.get("required"), list) else []:
            if key not in value:
                problems.append(f"{where}.{key} is required")
        for key, sub in value.items():
            if key in props:
                problems += value_problems(sub, props[key], f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                problems.append(f"{where}.{key} is not a known parameter")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problems += value_problems(item, schema["items"], f"{where}[{i}]")
    return problems
