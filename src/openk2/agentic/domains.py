"""Hierarchical domain evolution (report 3.1.1, Figure 9): categories -> application domains -> tools.

Starting from a few key categories (the report names financial trading, software apps and robot control),
a model proposes concrete application domains inside each category, then designs specialised tools for
each domain with clear names, descriptions, typed and described parameters, and a return schema. Every
model reply goes through `ask_json` and every tool through `synthetic_tool` (schema validation); bad ones
are counted and dropped, never patched up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from openk2.agentic.jsonout import JSON_INSTRUCTION, JSONStats, ask_json
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


async def evolve_domains(model: ChatModel, category: str, num_domains: int, *, stats: JSONStats | None = None,
                         max_attempts: int = 3, **sampling: Any) -> list[Domain]:
    """Up to `num_domains` application domains inside `category` (fewer if the model gives fewer)."""
    prompt = (f"Category: {category}\nList {num_domains} distinct, concrete application domains within this "
              "category where software tools or APIs are used (e.g. for 'financial trading': 'options "
              "portfolio risk'). Answer as JSON: "
              f'{{"domains": [{{"name": "{_DOMAIN_PLACEHOLDER}", "description": "one sentence"}}]}}. '
              + JSON_INSTRUCTION)
    got = await ask_json(model, [{"role": "user", "content": prompt}], _domains_validator(num_domains),
                         max_attempts=max_attempts, stats=stats, **sampling)
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
        "order_id": {"type": "string", "description": "The order's id, e.g. 'A-1029'."}}, "required": ["order_id"]},
    "returns": {"type": "object", "properties": {"status": {"type": "string"}, "eta": {"type": "string"}}},
}


def _tools_validator(value: Any) -> list[dict]:
    if isinstance(value, dict) and isinstance(value.get("tools"), list):
        value = value["tools"]
    if isinstance(value, dict) and "name" in value:
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError('expected {"tools": [tool, ...]}')
    if not any(not tool_problems(t) for t in value):
        raise ValueError("no tool is valid: " + "; ".join(tool_problems(value[0]))[:400])
    return value


async def synthesize_tools(model: ChatModel, domain: Domain, num_tools: int, *, stats: JSONStats | None = None,
                           max_attempts: int = 3, **sampling: Any) -> tuple[list[Tool], int]:
    """(valid tools, number rejected by schema validation) for one domain."""
    prompt = (f"Domain: {domain.name} ({domain.category}): {domain.description}\n"
              f"Design {num_tools} specialised tools (functions) an assistant could call in this domain. Each "
              "has a snake_case name, a one-sentence description, JSON-Schema `parameters` (type object; every "
              "property typed and described; `required` listed) and a JSON-Schema `returns`. Example tool:\n"
              f"{json.dumps(_TOOL_EXAMPLE)}\nAnswer as JSON: {{\"tools\": [...]}}. {JSON_INSTRUCTION}")
    got = await ask_json(model, [{"role": "user", "content": prompt}], _tools_validator,
                         max_attempts=max_attempts, stats=stats, **sampling)
    tools: list[Tool] = []
    rejected = 0
    origin = {"model": getattr(model, "name", "model"), "domain_id": domain.domain_id}
    for record in (got or [])[:num_tools]:
        try:
            tools.append(synthetic_tool(record, category=domain.category, domain=domain.name, origin=origin))
        except ValueError:
            rejected += 1
    return tools, rejected
