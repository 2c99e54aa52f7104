"""The tool declarations the conformance request set draws from: real-shaped OpenAI function schemas with
nested objects, enums, arrays of objects, optional and nullable fields, patterns, bounds and anyOf."""

from __future__ import annotations


def _fn(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    out = {"type": "object", "properties": properties, **extra}
    if required:
        out["required"] = required
    return out


_STR = {"type": "string"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}

TOOLS: dict[str, dict] = {t["function"]["name"]: t for t in [
    _fn("get_weather", "Current weather and a short forecast for a city.", _obj({
        "city": {"type": "string", "enum": ["Paris", "Beijing", "Lima", "Nairobi", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7, "description": "forecast length"},
        "units": {"type": "string", "enum": ["metric", "imperial"]}}, ["city"], additionalProperties=False)),
    _fn("book_flight", "Book a flight for one or more passengers.", _obj({
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$", "description": "IATA airport code"},
        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "date": {"type": "string", "pattern": "^2027-[01][0-9]-[0-3][0-9]$", "description": "YYYY-MM-DD"},
        "cabin": {"type": "string", "enum": ["economy", "premium", "business", "first"]},
        "passengers": {"type": "array", "minItems": 1, "maxItems": 4, "items": _obj({
            "name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "seat": {"type": "string", "enum": ["window", "aisle", "middle"]},
            "loyalty": _obj({"program": {"type": "string", "enum": ["sky", "star", "one"]},
                             "number": _STR}, ["program", "number"])}, ["name", "age"])}},
        ["origin", "destination", "date", "passengers"])),
    _fn("create_event", "Create a calendar event.", _obj({
        "title": _STR, "start": {"type": "string", "description": "ISO 8601 start time"},
        "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
        "attendees": {"type": "array", "items": _obj({"email": _STR, "optional": _BOOL}, ["email"])},
        "recurrence": _obj({"freq": {"type": "string", "enum": ["daily", "weekly", "monthly"]},
                            "count": {"type": "integer", "minimum": 1, "maximum": 52}}, ["freq"]),
        "reminder": {"type": ["integer", "null"], "description": "minutes before; null for none"}},
        ["title", "start"])),
    _fn("search_products", "Search the catalogue.", _obj({
        "query": _STR,
        "filters": _obj({"category": {"type": "string", "enum": ["books", "electronics", "garden", "toys"]},
                         "price": _obj({"min": {"type": "number", "minimum": 0},
                                        "max": {"type": "number", "minimum": 0}}),
                         "in_stock": _BOOL}),
        "sort": {"type": "string", "enum": ["relevance", "price_asc", "price_desc", "newest"]},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50}}, ["query"])),
    _fn("run_sql", "Run a read-only SQL query.", _obj({
        "database": {"type": "string", "enum": ["sales", "inventory", "hr"]}, "query": _STR,
        "params": {"type": "array", "maxItems": 8, "items": {"anyOf": [_STR, {"type": "number"}, _BOOL]}},
        "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 30}}, ["database", "query"])),
    _fn("send_email", "Send an email.", _obj({
        "to": {"type": "array", "minItems": 1, "items": _STR}, "cc": {"type": "array", "items": _STR},
        "subject": _STR, "body": _STR,
        "priority": {"type": "string", "enum": ["low", "normal", "high"]}}, ["to", "subject", "body"])),
    _fn("file_op", "Read, write or delete a file in the workspace.", _obj({
        "path": _STR, "operation": {"type": "string", "enum": ["read", "write", "delete", "stat"]},
        "content": {"type": ["string", "null"]}, "create_parents": _BOOL}, ["path", "operation"])),
    _fn("scale_deployment", "Scale a Kubernetes deployment.", _obj({
        "namespace": _STR, "deployment": _STR, "replicas": {"type": "integer", "minimum": 0, "maximum": 100},
        "dry_run": _BOOL}, ["namespace", "deployment", "replicas"], additionalProperties=False)),
    _fn("translate", "Translate text between languages.", _obj({
        "text": _STR, "source": {"type": "string", "enum": ["auto", "en", "zh", "fr", "es", "de"]},
        "target": {"type": "string", "enum": ["en", "zh", "fr", "es", "de"]},
        "formality": {"type": "string", "enum": ["formal", "informal"]}}, ["text", "target"])),
    _fn("create_ticket", "Open a ticket in the issue tracker.", _obj({
        "title": _STR, "severity": {"type": "integer", "enum": [1, 2, 3, 4]},
        "labels": {"type": "array", "uniqueItems": True, "maxItems": 3,
                   "items": {"type": "string", "enum": ["bug", "ui", "backend", "security", "docs"]}},
        "reporter": _obj({"name": _STR, "team": {"type": "string", "enum": ["core", "infra", "web"]}}, ["name"]),
        "steps": {"type": "array", "maxItems": 5, "items": _obj({"order": {"type": "integer", "minimum": 1},
                                                               "action": _STR}, ["order", "action"])}},
        ["title", "severity"])),
    _fn("get_quotes", "Latest stock quotes.", _obj({
        "symbols": {"type": "array", "minItems": 1, "maxItems": 5,
                    "items": {"type": "string", "pattern": "^[A-Z]{1,5}$"}},
        "currency": {"type": "string", "enum": ["USD", "EUR", "CNY"]}}, ["symbols"])),
    _fn("get_time", "The current time (no arguments).", {"type": "object", "properties": {}}),
    _fn("update_config", "Change the service configuration.", _obj({
        "service": {"type": "string", "enum": ["api", "worker", "gateway"]},
        "settings": _obj({
            "network": _obj({"proxy": _obj({"host": _STR, "port": {"type": "integer", "minimum": 1,
                                                                    "maximum": 65535}}, ["host", "port"]),
                             "timeouts": _obj({"connect_ms": _INT, "read_ms": _INT})}),
            "features": {"type": "object", "additionalProperties": _BOOL},
            "log_level": {"type": "string", "enum": ["debug", "info", "warning", "error"]}})},
        ["service", "settings"])),
    _fn("convert_units", "Convert a quantity between units.", _obj({
        "value": {"type": "number"}, "from_unit": {"type": "string", "enum": ["km", "mi", "kg", "lb", "c", "f"]},
        "to_unit": {"type": "string", "enum": ["km", "mi", "kg", "lb", "c", "f"]},
        "precision": {"type": "integer", "minimum": 0, "maximum": 6, "default": 2}},
        ["value", "from_unit", "to_unit"])),
]}
