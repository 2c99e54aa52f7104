"""The stateful world: entity kinds inferred from tool specs, a seeded database, consistency across calls."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from openk2.agentic.schema import value_problems
from openk2.agentic.simulate import FaultConfig, ToolSimulator
from openk2.agentic.tools import Tool
from openk2.agentic.world import World, plan_tool


def _tool(name, props, returns, required=()):
    params = {"type": "object", "properties": {k: {"type": t, "description": k} for k, t in props.items()},
              "required": list(required)}
    return Tool(name=name, description=f"{name} tool.", parameters=params, returns=returns, source="synthetic")


ORDER = {"type": "object", "properties": {"order_id": {"type": "string"}, "item": {"type": "string"},
                                          "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                                          "status": {"type": "string", "enum": ["open", "shipped"]},
                                          "address": {"type": "string"}}}
ORDERS = [
    _tool("create_order", {"item": "string", "quantity": "integer", "customer_id": "string"}, ORDER,
          ["item", "quantity"]),
    _tool("get_order", {"order_id": "string"}, ORDER, ["order_id"]),
    _tool("get_order_status", {"order_id": "string"},
          {"type": "object", "properties": {"status": {"type": "string", "enum": ["open", "shipped"]},
                                            "eta": {"type": "string"}}}, ["order_id"]),
    _tool("list_orders", {"status": "string", "limit": "integer"},
          {"type": "object", "properties": {"orders": {"type": "array", "items": ORDER},
                                            "total": {"type": "integer"}}}),
    _tool("update_order_address", {"order_id": "string", "address": "string"}, ORDER, ["order_id", "address"]),
    _tool("cancel_order", {"order_id": "string"},
          {"type": "object", "properties": {"order_id": {"type": "string"}, "cancelled": {"type": "boolean"}}},
          ["order_id"]),
    _tool("get_customer", {"customer_id": "string"},
          {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}}},
          ["customer_id"]),
    _tool("get_stock_quote", {"symbol": "string"},
          {"type": "object", "properties": {"price": {"type": "number"}}}, ["symbol"]),
]
NO_FAULTS = FaultConfig(timeout=0, rate_limit=0, partial=0, edge_case=0)


def _sim(seed=0, key="shop", tools=ORDERS, faults=NO_FAULTS):
    return ToolSimulator(tools, seed=seed, episode_id="ep", world_key=key, faults=faults)


def _do(sim, name, **args):
    call = {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
    return json.loads(asyncio.run(sim.execute(call)))


@pytest.mark.parametrize("name,op,kind,id_param", [
    ("create_order", "create", "order", None), ("get_order", "read", "order", "order_id"),
    ("get_order_status", "read", "order", "order_id"), ("list_orders", "list", "order", None),
    ("update_order_address", "update", "order", "order_id"), ("cancel_order", "delete", "order", "order_id"),
    ("get_customer", "read", "customer", "customer_id"), ("get_stock_quote", "action", "quote", None),
])
def test_operations_and_kinds_are_inferred_from_the_specs(name, op, kind, id_param):
    plan = plan_tool(next(t for t in ORDERS if t.name == name))
    assert (plan.op, plan.kind, plan.id_param) == (op, kind, id_param)
    assert plan_tool(next(t for t in ORDERS if t.name == "create_order")).refs == {"customer_id": "customer"}
    reserve = _tool("cancel_booking", {"reservation_id": "string"}, {"type": "object"})
    assert (plan_tool(reserve).op, plan_tool(reserve).kind) == ("delete", "reservation")  # the id names the table


def test_create_fetch_update_delete_fetch_is_consistent():
    sim = _sim()
    customer = next(iter(sim.world.tables["customer"]))
    made = _do(sim, "create_order", item="lamp", quantity=2, customer_id=customer)
    oid = made["order_id"]
    assert made["item"] == "lamp" and made["quantity"] == 2
    first, second = _do(sim, "get_order", order_id=oid), _do(sim, "get_order", order_id=oid)
    assert first == second == made  # the same fields, twice, as created
    status = _do(sim, "get_order_status", order_id=oid)
    assert status["status"] == first["status"] and status == _do(sim, "get_order_status", order_id=oid)
    moved = _do(sim, "update_order_address", order_id=oid, address="1 Moon Street")
    assert moved == {**first, "address": "1 Moon Street"} == _do(sim, "get_order", order_id=oid)
    assert sim.state.changed == {oid: {"address": "1 Moon Street"}}
    listed = _do(sim, "list_orders", limit=20)
    assert oid in [o["order_id"] for o in listed["orders"]] and listed["total"] == len(listed["orders"])
    cancelled = _do(sim, "cancel_order", order_id=oid)
    assert cancelled["order_id"] == oid and isinstance(cancelled["cancelled"], bool)
    gone = _do(sim, "get_order", order_id=oid)
    assert gone["error"] == "not_found" and oid in gone["message"]
    assert _do(sim, "cancel_order", order_id=oid)["error"] == "not_found"
    assert oid not in [o["order_id"] for o in _do(sim, "list_orders", limit=20)["orders"]]
    assert sim.state.deleted == [oid] and oid not in sim.state.created and oid not in sim.state.changed


def test_seeded_rows_ids_and_references():
    sim = _sim()
    orders = sim.world.tables["order"]
    assert len(orders) == 5 and all(oid.startswith("ORD-") for oid in orders)
    oid, row = next(iter(orders.items()))
    assert _do(sim, "get_order", order_id=oid) == {k: row[k] for k in ORDER["properties"]}
    assert _do(sim, "get_order", order_id="ORD-0000")["error"] == "not_found"  # never invented
    bad_ref = _do(sim, "create_order", item="x", quantity=1, customer_id="CUS-0")
    assert bad_ref["error"] == "not_found" and "customer" in bad_ref["message"] and sim.state.created == {}
    shipped = _do(sim, "list_orders", status="shipped")
    assert all(o["status"] == "shipped" for o in shipped["orders"])
    assert len(shipped["orders"]) == sum(r["status"] == "shipped" for r in orders.values())
    assert len(_do(sim, "list_orders", limit=2)["orders"]) == 2


def test_actions_without_an_entity_answer_the_same_arguments_the_same_way():
    sim = _sim()
    a, b = _do(sim, "get_stock_quote", symbol="MSFT"), _do(sim, "get_stock_quote", symbol="MSFT")
    assert a == b and isinstance(a["price"], float)
    prices = {_do(sim, "get_stock_quote", symbol=f"S{i}")["price"] for i in range(10)}
    assert len(prices) > 5  # other arguments, other draws
    assert sim.state.created == {} and sim.state.changed == {}


def test_the_world_is_deterministic_in_seed_and_key():
    def play(seed, key):
        sim = _sim(seed, key, faults=FaultConfig(timeout=0.1, rate_limit=0.1, partial=0.1, edge_case=0.1))
        rng = random.Random(5)
        out = []
        for _ in range(40):
            tool = rng.choice(ORDERS)
            ids = list(sim.world.tables["order"])
            args = {"item": "pen", "quantity": 3} if tool.name == "create_order" else \
                {"order_id": rng.choice(ids + ["ORD-1"]), "address": "x"} if "order_id" in \
                tool.parameters["properties"] else {"symbol": "K"} if tool.name == "get_stock_quote" else \
                {"customer_id": rng.choice(list(sim.world.tables["customer"]))} if tool.name == "get_customer" \
                else {}
            args = {k: v for k, v in args.items() if k in tool.parameters["properties"]}
            out.append(_do(sim, tool.name, **args))
        return out, sim.record()

    first, again, other_key = play(3, "shop"), play(3, "shop"), play(3, "bank")
    assert first == again
    assert World(ORDERS, seed=3, key="shop").tables != World(ORDERS, seed=3, key="bank").tables
    assert World(ORDERS, seed=3, key="shop").tables != World(ORDERS, seed=4, key="shop").tables
    assert other_key[1]["entities"] != first[1]["entities"]
    outcomes = {c["outcome"] for c in first[1]["calls"]}
    assert {"ok", "not_found"} <= outcomes  # the sequence reached both real answers and misses


def test_results_fit_the_return_schemas_and_the_state_is_json():
    sim = _sim(faults=FaultConfig(timeout=0, rate_limit=0, partial=0, edge_case=0.3))
    by_name = {t.name: t for t in ORDERS}
    for oid in list(sim.world.tables["order"]):
        for name in ("get_order", "get_order_status", "update_order_address", "cancel_order"):
            got = _do(sim, name, order_id=oid, **({"address": "y"} if name == "update_order_address" else {}))
            if "error" not in got:
                assert value_problems(got, by_name[name].returns) == [], (name, got)
    listed = _do(sim, "list_orders")
    assert "error" in listed or value_problems({k: listed[k] for k in ("orders", "total") if k in listed},
                                               by_name["list_orders"].returns) == []
    state = json.loads(json.dumps(sim.record()))
    assert set(state) >= {"created", "changed", "deleted", "entities", "calls", "kinds"}
    assert state["kinds"]["order"]["rows"] == len(sim.world.tables["order"])


def test_bad_world_config():
    with pytest.raises(ValueError, match="rows_per_kind"):
        World(ORDERS, seed=0, key="k", rows_per_kind=-1)


def _random_schema(rng, depth=0):
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "object"] if depth < 3 else
                      ["string", "integer", "enum"])
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["a", "b", "c", "d"], rng.randint(1, 3))}
    if kind == "array":
        return {"type": "array", "items": _random_schema(rng, depth + 1)}
    if kind == "object":
        return {"type": "object", "properties": {f"f{i}": _random_schema(rng, depth + 1)
                                                 for i in range(rng.randint(0, 3))}}
    if kind == "integer" and rng.random() < 0.5:
        return {"type": "integer", "minimum": rng.randint(-5, 5), "maximum": rng.randint(5, 50)}
    return {"type": kind}


def _random_tools(rng):
    verbs = ["create", "get", "list", "update", "delete", "calculate", "search", "cancel", "send"]
    nouns = ["order", "orders", "account", "trade", "robot", "arm_joint", "alert", "status"]
    tools = {}
    for _ in range(rng.randint(2, 7)):
        noun = rng.choice(nouns)
        props = {f"p{i}": _random_schema(rng) for i in range(rng.randint(0, 3))}
        for ref in rng.sample(["order_id", "account_id", "id", "robot_id", "trade_id"], rng.randint(0, 2)):
            props[ref] = {"type": rng.choice(["string", "integer"])}
        name = f"{rng.choice(verbs)}_{noun}"
        returns = rng.choice([_random_schema(rng), {"type": "object"}, {}, {"type": "array", "items":
                                                                           _random_schema(rng)}])
        tools[name] = Tool(name=name, description="A tool.", source="synthetic", returns=returns,
                           parameters={"type": "object", "properties": props})
    return list(tools.values())


@pytest.mark.parametrize("case", range(25))
def test_random_specs_and_calls_never_crash_and_results_fit_their_schemas(case):
    """Model-written tool specs are adversarial too: any spec, any valid or junk call, never an exception."""
    from openk2.agentic.world import fake_value

    rng = random.Random(case)
    tools = _random_tools(rng)
    sim = ToolSimulator(tools, seed=case, episode_id="fuzz", faults=FaultConfig(timeout=0, rate_limit=0,
                                                                                partial=0.1, edge_case=0.1))
    for _ in range(30):
        tool = rng.choice(tools)
        args = fake_value(tool.parameters, rng, "arg")
        ids = [i for t in sim.world.tables.values() for i in t]
        for key in args:
            if key.endswith("id") and ids and rng.random() < 0.7:
                pick = rng.choice(ids)
                args[key] = int(pick) if pick.isdigit() and tool.parameters["properties"][key]["type"] == \
                    "integer" else pick
        if rng.random() < 0.1:
            args = rng.choice([[], "junk", {"p0": {"deep": [1, [2, [3]]]}}, None])
        got = _do(sim, tool.name, **args) if isinstance(args, dict) else json.loads(asyncio.run(sim.execute(
            {"function": {"name": tool.name, "arguments": json.dumps(args)}})))
        outcome = sim.world.calls[-1]["outcome"]
        if outcome == "ok":
            assert value_problems(got, tool.returns or {}) == [], (tool.name, tool.returns, got)
    json.loads(json.dumps(sim.record()))
