"""A seeded, stateful world per domain: the database behind the simulated tools (report 3.1.1, where the tool
simulator is "functionally a world model").

`World(tools, seed=, key=)` reads the tool specs and infers entity kinds and what each tool does to them
(`plan_tool`): `create_order(...)` creates an order, `get_order(order_id)` reads one, `list_orders(status)`
filters them, `update_order(order_id, ...)` changes one and `cancel_order(order_id)` removes it; any other verb
is an action on the entity it names (or on none). Each kind gets a table seeded with `rows_per_kind` entities
whose fields are faked from the union of the kind's schemas (create and update parameters, read and list
return schemas), keyed by (seed, key, kind): a domain's starting database is the same in every episode.

A result is the entity projected onto the tool's return schema. A field the entity lacks is faked once
(seeded by entity and field) and stored, so fetching twice gives the same answer; an action without an
entity answers the same arguments the same way. An id that is not in the table is a `not_found` error, never
an invention. Filters the world does not know (date ranges, free-form options) are ignored, not guessed.
`to_dict()` is the final state: what was created, changed and deleted, every table, and the call log.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from typing import Any

from openk2.agentic.schema import value_problems
from openk2.agentic.tools import Tool

CREATE_VERBS = ("create", "add", "new", "book", "place", "schedule", "register", "open", "insert", "upload", "send",
                "submit", "post", "make")
READ_VERBS = ("get", "fetch", "retrieve", "read", "show", "view", "check", "lookup", "describe", "load", "track",
              "inspect")
LIST_VERBS = ("list", "search", "find", "query", "browse", "filter", "scan")
CHANGE_VERBS = ("update", "set", "modify", "edit", "change", "move", "rename", "assign", "adjust", "transfer",
                "patch", "reschedule", "mark")
DELETE_VERBS = ("delete", "remove", "cancel", "close", "drop", "archive", "revoke", "clear")
_ATTRIBUTE_WORDS = {"status", "details", "detail", "info", "information", "summary", "history", "by", "id", "ids",
                    "all", "data", "list", "state", "current", "new"}
_PAGINATION = {"limit", "max_results", "page", "offset", "page_size", "sort", "sort_by", "order_by", "cursor"}
_QUERY = {"query", "q", "search", "keyword", "keywords", "text", "term"}
_COUNT_NAMES = {"count", "total", "total_count", "num_results", "num_items"}
MAX_ROWS = 20  # a list call returns at most this many rows


def singular(word: str) -> str:
    """A crude English singular: orders -> order, entries -> entry, addresses -> address."""
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("sses", "xes", "ches", "shes")):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is")) and len(word) > 3:
        return word[:-1]
    return word


def fake_value(schema: Any, rng: random.Random, hint: str = "value", depth: int = 0) -> Any:
    """A value that satisfies `schema` (the subset in `schema.py`), drawn from `rng`."""
    if not isinstance(schema, dict):
        return f"{hint}-{rng.randrange(1000)}"
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    kind = schema.get("type", "object" if "properties" in schema else "string")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if kind == "object":
        props = schema.get("properties", {}) if depth < 4 and isinstance(schema.get("properties"), dict) else {}
        return {k: fake_value(v, rng, k, depth + 1) for k, v in props.items()}
    if kind == "array":
        return [fake_value(schema.get("items", {}), rng, hint, depth + 1) for _ in range(rng.randint(1, 3))]
    if kind == "integer":
        lo, hi = int(schema.get("minimum", 0)), int(schema.get("maximum", 100))
        return rng.randint(lo, max(lo, hi))
    if kind == "number":
        lo, hi = float(schema.get("minimum", 0.0)), float(schema.get("maximum", 1000.0))
        return round(rng.uniform(lo, max(lo, hi)), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return f"{hint}-{rng.randrange(1000)}"


@dataclass
class ToolPlan:
    """What one tool does to the world: its operation on entities of `kind`, addressed by `id_param`."""

    name: str
    op: str  # create | read | list | update | delete | action
    kind: str
    id_param: str | None = None  # the parameter holding the entity's id (read, update, delete, action)
    refs: dict[str, str] | None = None  # other *_id parameters -> the kind they point at


def _noun_kind(nouns: list[str]) -> str:
    words = [singular(w) for w in nouns if w and w not in _ATTRIBUTE_WORDS]
    return words[-1] if words else "record"


def _props(schema: Any) -> dict[str, Any]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def plan_tool(tool: Tool) -> ToolPlan:
    """Infer the operation and entity kind of `tool` from its name and parameters."""
    tokens = [t for t in tool.name.lower().split("_") if t]
    verb, nouns = (tokens[0], tokens[1:]) if tokens else ("", [])
    op = next((op for op, verbs in (("create", CREATE_VERBS), ("read", READ_VERBS), ("list", LIST_VERBS),
                                    ("update", CHANGE_VERBS), ("delete", DELETE_VERBS)) if verb in verbs), "action")
    params = _props(tool.parameters)
    id_params = [p for p in params if p.lower() == "id" or p.lower().endswith("_id")]
    name_nouns = {singular(n) for n in nouns}
    kind, id_param = _noun_kind(nouns), None
    if op in ("read", "update", "delete", "action") and id_params:
        required = tool.parameters.get("required", []) if isinstance(tool.parameters, dict) else []
        matching = [p for p in id_params if p.lower() != "id" and singular(p.lower()[:-3].split("_")[-1]) in name_nouns]
        id_param = (matching or [p for p in id_params if p.lower() == "id"]
                    or [p for p in id_params if p in (required if isinstance(required, list) else [])]
                    or id_params)[0]
        if id_param.lower() != "id":
            kind = "_".join(singular(w) for w in id_param.lower()[:-3].split("_") if w) or kind
    if op == "read" and id_param is None:
        op = "action"  # e.g. get_stock_quote(symbol): no entity named, answered per arguments
    if op in ("update", "delete") and id_param is None:
        op = "action"
    refs = {p: "_".join(singular(w) for w in p.lower()[:-3].split("_") if w) for p in id_params
            if p != id_param and p.lower() != "id"}
    return ToolPlan(name=tool.name, op=op, kind=kind, id_param=id_param, refs=refs)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _type_of(schema: Any) -> str:
    kind = schema.get("type") if isinstance(schema, dict) else None
    kind = kind[0] if isinstance(kind, list) and kind else kind
    return kind if isinstance(kind, str) else ("object" if _props(schema) else "")


class World:
    """The database of one episode: tables per entity kind, seeded from the tools' schemas; see the module doc."""

    def __init__(self, tools: list[Tool], *, seed: int, key: str, rows_per_kind: int = 5) -> None:
        if rows_per_kind < 0:
            raise ValueError(f"rows_per_kind must be >= 0, got {rows_per_kind}")
        self.seed, self.key = seed, key
        self.tools = {t.name: t for t in tools}
        self.plans = {t.name: plan_tool(t) for t in tools}
        self.fields: dict[str, dict[str, Any]] = {}
        self.integer_ids: set[str] = set()
        for t in tools:
            self._learn(t, self.plans[t.name])
        self.tables: dict[str, dict[str, dict]] = {}
        self.generated: dict[tuple[str, str], set[str]] = {}  # (kind, id) -> fields faked, not set by a call
        self._new_ids = {k: random.Random(f"{seed}:world:{key}:{k}:new") for k in self.fields}
        for kind in sorted(self.fields):
            self.tables[kind] = {}
            rng = random.Random(f"{seed}:world:{key}:{kind}")
            for _ in range(rows_per_kind):
                eid = self._new_id(kind, rng)
                row = {self.id_field(kind): self._id_value(kind, eid)}
                row.update({f: fake_value(s, rng, f) for f, s in self.fields[kind].items() if f not in row})
                self.tables[kind][eid] = row
                self.generated[(kind, eid)] = set(row) - {self.id_field(kind)}
        self.created: dict[str, Any] = {}
        self.changed: dict[str, Any] = {}
        self.deleted: list[str] = []
        self.calls: list[dict] = []

    def _learn(self, tool: Tool, plan: ToolPlan) -> None:
        fields = self.fields.setdefault(plan.kind, {})
        params = _props(tool.parameters)
        if plan.id_param and _type_of(params.get(plan.id_param)) == "integer":
            self.integer_ids.add(plan.kind)
        sources = []  # what reads show first, so seeded rows fit the return schemas
        if plan.op in ("read", "update", "delete", "create") or (plan.op == "action" and plan.id_param):
            sources.append(_props(tool.returns))
        if plan.op == "list":
            for sub in _props(tool.returns).values():
                if _type_of(sub) == "array":
                    sources.append(_props(sub.get("items")))
            if _type_of(tool.returns) == "array":
                sources.append(_props(tool.returns.get("items")))
        if plan.op in ("create", "update"):
            sources.append({k: v for k, v in params.items() if k != plan.id_param})
        for source in sources:
            for name, schema in source.items():
                if not self.is_id_name(plan.kind, name) and name not in _COUNT_NAMES:
                    fields.setdefault(name, schema)

    @staticmethod
    def id_field(kind: str) -> str:
        """The field holding an entity's id, e.g. order_id."""
        return f"{kind}_id"

    def is_id_name(self, kind: str, name: str) -> bool:
        """Whether a parameter or result field named `name` is the id of a `kind` entity."""
        low = name.lower()
        return low == "id" or low == self.id_field(kind) or (
            low.endswith("_id") and "_".join(singular(w) for w in low[:-3].split("_") if w) == kind)

    def _new_id(self, kind: str, rng: random.Random) -> str:
        prefix = "".join(w[0] for w in kind.split("_")).upper() if "_" in kind else kind[:3].upper()
        while True:
            number = rng.randrange(1000, 100000)
            eid = str(number) if kind in self.integer_ids else f"{prefix}-{number}"
            if eid not in self.tables.get(kind, {}):
                return eid

    def _id_value(self, kind: str, eid: str) -> Any:
        return int(eid) if kind in self.integer_ids else eid

    # -- calls -------------------------------------------------------------------------------------------------

    def call(self, name: str, args: dict) -> tuple[str, Any, tuple[str, str] | None]:
        """Execute tool `name` (arguments already validated): (status ok | not_found, result, touched entity)."""
        plan, returns = self.plans[name], self.tools[name].returns
        missing = self._missing_ref(plan, args)
        if missing is not None:
            return "not_found", missing, None
        if plan.op == "create":
            kind = plan.kind
            eid = self._new_id(kind, self._new_ids[kind])
            row = {self.id_field(kind): self._id_value(kind, eid)}
            row.update({k: copy.deepcopy(v) for k, v in args.items() if not self.is_id_name(kind, k)})
            rng = random.Random(f"{self.seed}:world:{self.key}:{kind}:{eid}")
            faked = {f: fake_value(s, rng, f) for f, s in self.fields[kind].items() if f not in row}
            row.update(faked)
            self.tables[kind][eid] = row
            self.generated[(kind, eid)] = set(faked)
            result = self.render(returns, kind, eid)
            self.created[eid] = copy.deepcopy(row)
            return "ok", result, (kind, eid)
        if plan.op == "list":
            return "ok", self._render_rows(name, args, self._matching(plan.kind, args)), None
        if plan.id_param is None:  # an action naming no entity: the same arguments get the same answer
            rng = random.Random(f"{self.seed}:world:{self.key}:{name}:{_canonical(args)}")
            return "ok", fake_value(returns or {"type": "object", "properties": {"status": {"enum": ["ok"]}}},
                                    rng, name), None
        kind, eid = plan.kind, str(args.get(plan.id_param))
        if eid not in self.tables.get(kind, {}):
            return "not_found", self.not_found(kind, plan.id_param, args.get(plan.id_param)), None
        if plan.op == "update":
            changes = {k: copy.deepcopy(v) for k, v in args.items() if k != plan.id_param}
            self.tables[kind][eid].update(changes)
            self.generated[(kind, eid)] -= set(changes)
            if eid in self.created:
                self.created[eid].update(copy.deepcopy(changes))
            self.changed[eid] = {**self.changed.get(eid, {}), **copy.deepcopy(changes)}
        result = self.render(returns, kind, eid)
        if plan.op == "delete":
            del self.tables[kind][eid]
            self.created.pop(eid, None)
            self.changed.pop(eid, None)
            self.deleted.append(eid)
        return "ok", result, (kind, eid)

    def edge_case(self, name: str, args: dict) -> Any:
        """An injected edge case for this call, which changes nothing: no matching rows, a missing record, a
        conflicting create."""
        plan = self.plans[name]
        if plan.op == "list":
            result = self._render_rows(name, args, [])
            return {**result, "note": "no matching records found"} if isinstance(result, dict) else \
                {"result": result, "note": "no matching records found"}
        if plan.op == "create":
            return {"error": "conflict", "message": f"a {plan.kind} with these details already exists"}
        if plan.id_param is not None:
            return self.not_found(plan.kind, plan.id_param, args.get(plan.id_param))
        return {"error": "not_found", "message": "no record matches the given arguments"}

    @staticmethod
    def not_found(kind: str, param: str, value: Any) -> dict:
        """The error for an id that names no entity."""
        return {"error": "not_found", "message": f"no {kind} with {param} {str(value)[:80]!r}"}

    def _missing_ref(self, plan: ToolPlan, args: dict) -> dict | None:
        if plan.op == "list":
            return None  # a filter by an unknown id simply matches nothing
        for param, kind in (plan.refs or {}).items():
            if param in args and kind in self.tables and str(args[param]) not in self.tables[kind]:
                return self.not_found(kind, param, args[param])
        return None

    def _matching(self, kind: str, args: dict) -> list[tuple[str, dict]]:
        rows = list(self.tables.get(kind, {}).items())
        limit = MAX_ROWS
        for name, value in args.items():
            low = name.lower()
            if low in ("limit", "max_results", "page_size") and isinstance(value, int) and not isinstance(value, bool):
                limit = max(0, min(limit, value))
            elif low in _PAGINATION:
                continue
            elif low in _QUERY and isinstance(value, str):
                needle = value.lower()
                rows = [(i, r) for i, r in rows if any(needle in str(v).lower() for v in r.values())]
            elif any(name in r for _, r in rows) or name in self.fields.get(kind, {}) or self.is_id_name(kind, name):
                field = self.id_field(kind) if self.is_id_name(kind, name) else name
                rows = [(i, r) for i, r in rows if _same(r.get(field), value)]
        return rows[:limit]

    # -- rendering -------------------------------------------------------------------------------------------

    def render(self, schema: Any, kind: str, eid: str) -> Any:
        """Entity `eid` projected onto a return schema; missing fields are faked once and stored."""
        row = self.tables[kind][eid]
        props = _props(schema)
        if _type_of(schema) not in ("object", "") or (isinstance(schema, dict) and schema.get("enum")):
            return self._field(kind, eid, f"result_{_type_of(schema)}", schema)
        if not props:
            return copy.deepcopy(row)
        out: dict[str, Any] = {}
        if not any(self.is_id_name(kind, p) for p in props) and schema.get("additionalProperties") is not False:
            out[self.id_field(kind)] = row[self.id_field(kind)]
        for prop, sub in props.items():
            out[prop] = self._field(kind, eid, prop, sub)
        return out

    def _field(self, kind: str, eid: str, prop: str, schema: Any) -> Any:
        row = self.tables[kind][eid]
        if self.is_id_name(kind, prop):
            value = row[self.id_field(kind)]
            return str(value) if _type_of(schema) == "string" else value
        if prop in row and not value_problems(row[prop], schema if isinstance(schema, dict) else {}):
            return copy.deepcopy(row[prop])
        value = fake_value(schema, random.Random(f"{self.seed}:world:{self.key}:{kind}:{eid}:{prop}"), prop)
        if prop not in row:
            row[prop] = value
            self.generated.setdefault((kind, eid), set()).add(prop)
        return copy.deepcopy(value)

    def _render_rows(self, name: str, args: dict, rows: list[tuple[str, dict]]) -> Any:
        plan, schema = self.plans[name], self.tools[name].returns
        kind = plan.kind

        def item(schema_item: Any, eid: str) -> Any:
            if _type_of(schema_item) in ("string", "integer"):
                return self._field(kind, eid, self.id_field(kind), schema_item)
            return self.render(schema_item, kind, eid)

        def holds_rows(sub: Any) -> bool:  # an array of objects, or of ids of the right type
            items = sub.get("items") if isinstance(sub, dict) else None
            return _type_of(sub) == "array" and (_type_of(items) in ("object", "", "string") or (
                _type_of(items) == "integer" and kind in self.integer_ids)) and not (
                isinstance(items, dict) and {"enum", "minimum", "maximum"} & set(items))

        if _type_of(schema) == "array":
            return [item(schema.get("items"), eid) for eid, _ in rows] if holds_rows(schema) else \
                fake_value(schema, random.Random(f"{self.seed}:world:{self.key}:{name}:{_canonical(args)}"), name)
        rng = random.Random(f"{self.seed}:world:{self.key}:{name}:{_canonical(args)}")
        if _type_of(schema) not in ("object", "") or (isinstance(schema, dict) and schema.get("enum")):
            return fake_value(schema, rng, name)  # a scalar answer: no rows to show, the same one per arguments
        props = _props(schema)
        out: dict[str, Any] = {}
        listed = False
        for prop, sub in props.items():
            if holds_rows(sub) and not listed:
                out[prop] = [item(sub.get("items"), eid) for eid, _ in rows]
                listed = True
            elif prop in _COUNT_NAMES and _type_of(sub) == "integer":
                out[prop] = len(rows)
            else:
                out[prop] = fake_value(sub, rng, prop)
        if not listed and (not isinstance(schema, dict) or schema.get("additionalProperties") is not False):
            out["items"] = [copy.deepcopy(r) for _, r in rows]
        return out

    # -- phrasing and state ----------------------------------------------------------------------------------

    def phrasable(self, name: str, touched: tuple[str, str] | None, result: Any) -> list[str]:
        """Top-level text fields of `result` the world only faked (no enum, not an id, not set by any call)."""
        if touched is None or not isinstance(result, dict) or touched[1] not in self.tables.get(touched[0], {}):
            return []
        props = _props(self.tools[name].returns)
        faked = self.generated.get(touched, set())
        return [k for k, v in result.items() if k in faked and isinstance(v, str) and isinstance(props.get(k), dict)
                and _type_of(props[k]) == "string" and "enum" not in props[k]]

    def adopt(self, touched: tuple[str, str], texts: dict[str, str]) -> None:
        """Store phrased text for faked fields of an entity, so later reads return the same text."""
        kind, eid = touched
        row = self.tables[kind][eid]
        for field, text in texts.items():
            if field in self.generated.get(touched, set()):
                row[field] = text
                self.generated[touched].discard(field)
                if eid in self.created:
                    self.created[eid][field] = text

    def to_dict(self) -> dict:
        """The final state: created, changed and deleted records by id, every table, the call log."""
        return {"key": self.key, "seed": self.seed,
                "kinds": {k: {"id_field": self.id_field(k), "rows": len(t)} for k, t in self.tables.items()},
                "created": copy.deepcopy(self.created), "changed": copy.deepcopy(self.changed),
                "deleted": list(self.deleted), "entities": copy.deepcopy(self.tables), "calls": list(self.calls)}


def _same(stored: Any, wanted: Any) -> bool:
    if isinstance(stored, str) and isinstance(wanted, str):
        return stored.lower() == wanted.lower()
    if isinstance(stored, list) and not isinstance(wanted, list):
        return any(_same(s, wanted) for s in stored)
    return _canonical(stored) == _canonical(wanted) or (not isinstance(wanted, bool) and str(stored) == str(wanted))
