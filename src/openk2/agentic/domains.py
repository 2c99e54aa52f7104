"""Hierarchical domain evolution (report 3.1.1, Figure 9): categories -> application domains -> tools.

Starting from a few key categories (the report names financial trading, software apps and robot control),
a model proposes concrete application domains inside each category, then designs specialised tools for
each domain with clear names, descriptions, typed and described parameters, and a return schema. Every
request carries a JSON schema (`domains_schema`, `tools_schema`: local backends decode under its grammar) and
goes through `ask_structured`; every tool then goes through `synthetic_tool` (schema validation). Bad ones are
counted and dropped with the reason, never patched up. The one rewrite: a parameter's `"required": true` flag
(which a grammar can hold, unlike a `required` list naming properties) becomes the schema's `required` list.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from openk2.agentic.jsonout import JSON_INSTRUCTION, JSONStats, ask_structured
from openk2.agentic.tools import Tool, synthetic_tool, tool_problems
from openk2.llm.base import ChatModel

# The report's examples first, then a spread of other areas where tools are common.
SEED_CATEGORIES = (
    "financial trading", "software apps", "robot control", "e-commerce", "travel and transport",
    "healthcare", "smart home", "data analysis", "communication", "education", "developer tools", "logistics",
)


@dataclass
class Domain:
    """An application domain inside a category, e.g. ("financial trading", "crypto portfolio tracking")."""

    category: str
    name: str
    description: str

    @property
    def domain_id(self) -> str:
        return f"{self.category}/{self.name}"

    def to_dict(self) -> dict:
        return {"id": self.domain_id, "category": self.category, "name": self.name, "description": self.description}

    @classmethod
    def from_dict(cls, record: dict) -> Domain:
        return cls(category=record["category"], name=record["name"], description=record["description"])


_DOMAIN_PLACEHOLDER = "short domain name"  # small models copy the answer template; that is not a domain


def _domains_validator(n: int):
    def validate(value: Any) -> list[dict]:
        if isinstance(value, dict) and isinstance(value.get("domains"), list):
            value = value["domains"]
        if not isinstance(value, list):
            raise ValueError('expected {"domains": [{"name": ..., "description": ...}, ...]}')
        good = [d for d in value if isinstance(d, dict) and isinstance(d.get("name"), str) and d["name"].strip()
                and isinstance(d.get("description"), str) and d["name"] != _DOMAIN_PLACEHOLDER]
        if not good:
            raise ValueError("no domain has both a name and a description (and the name must be a real one, "
                             "not the placeholder)")
        return good[:n]
    return validate


def domains_schema(num_domains: int) -> dict:
    """The JSON schema of a domains reply: 1..num_domains named, described domains."""
    item = {"type": "object", "properties": {"name": {"type": "string", "minLength": 3, "maxLength": 60},
                                             "description": {"type": "string", "minLength": 10, "maxLength": 160}},
            "required": ["name", "description"]}
    return {"type": "object", "properties": {"domains": {"type": "array", "items": item, "minItems": 1,
                                                         "maxItems": max(1, num_domains)}},
            "required": ["domains"]}


async def evolve_domains(model: ChatModel, category: str, num_domains: int, *, stats: JSONStats | None = None,
                         max_attempts: int = 3, failures: list[str] | None = None, **sampling: Any) -> list[Domain]:
    """Up to `num_domains` application domains inside `category` (fewer if the model gives fewer); when the
    request gives up, its reason is appended to `failures`."""
    prompt = (f"Category: {category}\nList {num_domains} distinct, concrete application domains within this "
              "category where software tools or APIs are used. "
              'Answer as JSON with a "domains" list; each domain has a "name" (two to five '
              'words) and a "description" (one sentence). ' + JSON_INSTRUCTION)
    reply = await ask_structured(model, [{"role": "user", "content": prompt}], _domains_validator(num_domains),
                                 schema=domains_schema(num_domains), max_attempts=max_attempts, stats=stats,
                                 **sampling)
    if not reply.ok and failures is not None:
        failures.append(f"{reply.reason}: {reply.error}"[:300])
    got = reply.value if reply.ok else None
    seen: set[str] = set()
    domains = []
    for d in got or []:
        name = " ".join(d["name"].lower().split())
        if name not in seen:
            seen.add(name)
            domains.append(Domain(category=category, name=name, description=d["description"].strip()))
    return domains


_TOOL_EXAMPLE = {
    "name": "get_order_status",
    "description": "Look up the shipping status of an order by its id.",
    "parameters": {"type": "object", "properties": {
        "order_id": {"type": "string", "description": "The order's id, e.g. 'A-1029'.", "required": True}}},
    "returns": {"type": "object", "properties": {"status": {"type": "string"}, "eta": {"type": "string"}}},
}


_PARAM_TYPES = ["string", "integer", "number", "boolean"]
# What `tool_problems` checks, held by the grammar too (llguidance takes a pattern or a length bound, not both):
# a tool description of 3 to 24 words, a parameter description that starts with a letter.
_SENTENCE = "^[A-Za-z][^ ]{0,24}( [^ ]{1,24}){2,23}$"
_PARAM_TEXT = "^[A-Za-z][^\\n]{2,79}$"


def tools_schema(num_tools: int) -> dict:
    """The JSON schema of a tools reply: each tool a snake_case name, a description, parameters (typed,
    described, each flagged required or not) and a return object."""
    param = {"type": "object", "properties": {"type": {"enum": _PARAM_TYPES},
                                              "description": {"type": "string", "pattern": _PARAM_TEXT},
                                              "required": {"type": "boolean"}},
             "required": ["type", "description", "required"]}
    field_ = {"type": "object", "properties": {"type": {"enum": _PARAM_TYPES}}, "required": ["type"]}
    tool = {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,40}$"},
        "description": {"type": "string", "pattern": _SENTENCE},
        "parameters": {"type": "object", "properties": {
            "type": {"const": "object"},
            "properties": {"type": "object", "additionalProperties": param}}, "required": ["type", "properties"]},
        "returns": {"type": "object", "properties": {
            "type": {"const": "object"},
            "properties": {"type": "object", "additionalProperties": field_}}, "required": ["type", "properties"]}},
        "required": ["name", "description", "parameters", "returns"]}
    return {"type": "object", "properties": {"tools": {"type": "array", "items": tool, "minItems": 1,
                                                       "maxItems": max(1, num_tools)}}, "required": ["tools"]}


def with_required_list(record: Any) -> Any:
    """A tool record whose parameters carry per-property `"required": true|false` flags, as a JSON Schema with a
    `required` list (flags removed); records without flags are returned unchanged."""
    if not isinstance(record, dict) or not isinstance(record.get("parameters"), dict):
        return record
    params = record["parameters"]
    props = params.get("properties")
    if not isinstance(props, dict) or not any(isinstance(p, dict) and "required" in p for p in props.values()):
        return record
    required = list(params.get("required", [])) if isinstance(params.get("required"), list) else []
    clean = {}
    for key, sub in props.items():
        if isinstance(sub, dict):
            flag = sub.get("required")
            sub = {k: v for k, v in sub.items() if k != "required"}
            if flag is True and key not in required:
                required.append(key)
        clean[key] = sub
    return {**record, "parameters": {**params, "properties": clean, "required": required}}


def _tools_validator(value: Any) -> list[dict]:
    if isinstance(value, dict) and isinstance(value.get("tools"), list):
        value = value["tools"]
    if isinstance(value, dict) and "name" in value:
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError('expected {"tools": [tool, ...]}')
    value = [with_required_list(t) for t in value]
    if not any(not tool_problems(t) for t in value):
        raise ValueError("no tool is valid: " + "; ".join(tool_problems(value[0]))[:400])
    return value


async def synthesize_tools(model: ChatModel, domain: Domain, num_tools: int, *, stats: JSONStats | None = None,
                           max_attempts: int = 3, reasons: list[str] | None = None,
                           **sampling: Any) -> tuple[list[Tool], int]:
    """(valid tools, number rejected by schema validation) for one domain; each rejection's reason (or the
    request's, when it gave up) is appended to `reasons`."""
    prompt = (f"Domain: {domain.name} ({domain.category}): {domain.description}\n"
              f"Design {num_tools} specialised tools (functions) an assistant could call in this domain. Each "
              "has a snake_case name, a one-sentence description, JSON-Schema `parameters` (type object; every "
              "property typed, described and marked required true or false) and a JSON-Schema `returns`. "
              "Example tool:\n"
              f"{json.dumps(_TOOL_EXAMPLE)}\nAnswer as JSON: {{\"tools\": [...]}}. {JSON_INSTRUCTION}")
    reply = await ask_structured(model, [{"role": "user", "content": prompt}], _tools_validator,
                                 schema=tools_schema(num_tools), max_attempts=max_attempts, stats=stats, **sampling)
    reasons = reasons if reasons is not None else []
    if not reply.ok:
        reasons.append(f"request {reply.reason}: {reply.error}"[:300])
    tools: list[Tool] = []
    rejected = 0
    origin = {"model": getattr(model, "name", "model"), "domain_id": domain.domain_id}
    for record in (reply.value if reply.ok else [])[:num_tools]:
        try:
            tools.append(synthetic_tool(record, category=domain.category, domain=domain.name, origin=origin))
        except ValueError as err:
            rejected += 1
            reasons.append(str(err)[:300])
    return tools, rejected
