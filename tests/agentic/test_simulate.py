"""Tool-execution simulator: argument validation, per-episode state, seeded fault injection; user simulator."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from openk2.agentic.schema import value_problems
from openk2.agentic.simulate import FaultConfig, ToolSimulator, fake_value
from openk2.agentic.tools import Tool
from openk2.agentic.users import PERSONAS, UserSimulator, pick_persona
from openk2.llm.base import ChatModel, ChatResponse
from tests.agentic.fake_models import ScriptedModel

RETURNS = {"type": "object", "properties": {"status": {"type": "string", "enum": ["ok", "queued"]},
                                            "matches": {"type": "array", "items": {"type": "integer"}},
                                            "score": {"type": "number", "minimum": 0, "maximum": 1}}}
TOOLS = [
    Tool(name="create_ticket", description="Create a support ticket.", source="synthetic", returns=RETURNS,
         parameters={"type": "object", "additionalProperties": False, "required": ["title", "priority"],
                     "properties": {"title": {"type": "string"},
                                    "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                                    "tags": {"type": "array", "items": {"type": "string"}}}}),
    Tool(name="delete_ticket", description="Delete a ticket by id.", source="synthetic", returns=RETURNS,
         parameters={"type": "object", "properties": {"ticket_id": {"type": "string"}}, "required": ["ticket_id"]}),
    Tool(name="search_tickets", description="Search tickets.", source="synthetic", returns=RETURNS,
         parameters={"type": "object", "properties": {"query": {"type": "string"}}}),
]


def _call(name, args):
    return {"id": "x", "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}


def _run(sim, calls):
    return [json.loads(asyncio.run(sim.execute(c))) for c in calls]


NO_FAULTS = FaultConfig(timeout=0, rate_limit=0, partial=0, edge_case=0)


@pytest.mark.parametrize("args,expect", [
    ({"title": "printer"}, "arguments.priority is required"),
    ({"title": "printer", "priority": "high"}, "arguments.priority must be integer"),
    ({"title": "printer", "priority": 9}, "must be <= 5"),
    ({"title": "printer", "priority": 2, "owner": "me"}, "arguments.owner is not a known parameter"),
    ({"title": "printer", "priority": 2, "tags": ["a", 3]}, "arguments.tags[1] must be string"),
])
def test_arguments_are_validated_against_the_schema(args, expect):
    sim = ToolSimulator(TOOLS, seed=0, episode_id="e", faults=NO_FAULTS)
    (got,) = _run(sim, [_call("create_ticket", args)])
    assert got["error"] == "invalid_arguments" and any(expect in d for d in got["details"])
    assert sim.state.created == {} and sim.outcomes == {"invalid_arguments": 1}


def test_unknown_tool_and_non_json_arguments():
    sim = ToolSimulator(TOOLS, seed=0, episode_id="e", faults=NO_FAULTS)
    unknown, broken = _run(sim, [_call("launch_rocket", {}), _call("create_ticket", "{oops")])
    assert unknown["error"] == "unknown_tool" and "create_ticket" in unknown["available"]
    assert broken["error"] == "invalid_arguments" and "not JSON" in broken["message"]


def test_state_comes_from_the_world_and_results_fit_the_schema():
    sim = ToolSimulator(TOOLS, seed=3, episode_id="e", faults=NO_FAULTS)
    (created,) = _run(sim, [_call("create_ticket", {"title": "printer", "priority": 2})])
    tid = created["ticket_id"]
    deleted, again, searched = _run(sim, [_call("delete_ticket", {"ticket_id": tid}),
                                          _call("delete_ticket", {"ticket_id": tid}),
                                          _call("search_tickets", {"query": "printer"})])
    for result in (created, deleted, searched):
        assert value_problems(result, RETURNS) == []
    assert again["error"] == "not_found" and tid in again["message"]
    assert searched["items"] == []  # the only printer ticket is gone
    assert sim.state.deleted == [tid] and sim.state.created == {}
    invented = _run(sim, [_call("delete_ticket", {"ticket_id": "T-9"})])[0]  # an id the world never had
    assert invented["error"] == "not_found" and sim.state.deleted == [tid]
    assert [c["outcome"] for c in sim.state.calls] == ["ok", "ok", "not_found", "ok", "not_found"]
    assert json.loads(json.dumps(sim.record()))["entities"]["ticket"]  # the seeded rows, recorded


class PhrasingModel(ChatModel):
    """A simulator model that phrases text fields and also tries to rewrite ids, numbers and enums."""

    def __init__(self):
        self.prompts = []

    def chat(self, messages, tools=None, **sampling):
        self.prompts.append(messages[0]["content"])
        return [ChatResponse(content=json.dumps({"fields": {"title": "Printer on floor 3 jams",
                                                            "ticket_id": "FORGED", "priority": 5,
                                                            "status": "forged"}}))]


def test_a_model_phrases_faked_text_but_never_state():
    tools = [Tool(name="get_ticket", description="Fetch a ticket.", source="synthetic",
                  parameters={"type": "object", "properties": {"ticket_id": {"type": "string"}}},
                  returns={"type": "object", "properties": {"title": {"type": "string"},
                                                            "priority": {"type": "integer"},
                                                            "status": {"type": "string", "enum": ["ok", "queued"]}}})]
    model = PhrasingModel()
    sim = ToolSimulator(tools, seed=0, episode_id="e", faults=NO_FAULTS, model=model)
    tid = next(iter(sim.world.tables["ticket"]))
    stored = dict(sim.world.tables["ticket"][tid])
    first, second = _run(sim, [_call("get_ticket", {"ticket_id": tid})] * 2)
    assert first == second == {"ticket_id": tid, "title": "Printer on floor 3 jams", "priority": stored["priority"],
                               "status": stored["status"]}
    assert len(model.prompts) == 1  # the phrased title is stored: the second read needs no model
    assert sim.world.tables["ticket"][tid]["title"] == "Printer on floor 3 jams"
    (missing,) = _run(sim, [_call("get_ticket", {"ticket_id": "T-404"})])
    assert missing["error"] == "not_found" and len(model.prompts) == 1  # a model cannot invent a record


def _nested(depth):
    value = "x"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value, "n": None}
    return value


def test_hostile_arguments_are_tool_errors_not_crashes():
    sim = ToolSimulator(TOOLS, seed=0, episode_id="e", faults=NO_FAULTS)
    hostile = [
        _call("create_ticket", json.dumps({"title": "x" * 2_000_000, "priority": 1})),  # huge string
        _call("create_ticket", "[" * 100_000 + "]" * 100_000),  # nesting past the recursion limit
        _call("search_tickets", json.dumps({"query": "q", "junk": _nested(40)})),  # unchecked key, deep junk
        _call("create_ticket", '{"title": "t", "priority": NaN}'),
        _call("create_ticket", '{"title": "t", "priority": ' + "9" * 5000 + "}"),  # past int-parsing limits
        _call("create_ticket", '{"title": "\ud800", "priority": 1}'),  # a lone surrogate
        _call("create_ticket", {"title": ["not", "a", "string"], "priority": {"nested": {"junk": None}}}),
        _call("create_ticket", 12), _call("create_ticket", None), _call("create_ticket", "[1, 2]"),
        {"function": {"name": 7, "arguments": "{}"}}, {"function": "create_ticket"}, "not a call", None,
        _call("x" * 100_000, {}),
    ]
    results = _run(sim, hostile)
    assert all(r["error"] in ("invalid_arguments", "unknown_tool") for r in results), results
    assert all(len(json.dumps(r)) < 5000 for r in results)  # nothing hostile is echoed back at length
    assert sim.state.created == {} and len(sim.state.calls) == len(hostile)
    json.dumps(sim.record())  # the recorded state stays serialisable
    (ok,) = _run(sim, [_call("create_ticket", {"title": "printer", "priority": 2})])
    assert ok["ticket_id"] in sim.state.created  # the simulator still works


def _outcomes(seed, episode, faults, n=40):
    sim = ToolSimulator(TOOLS, seed=seed, episode_id=episode, faults=faults)
    results = _run(sim, [_call("search_tickets", {"query": f"q{i}"}) for i in range(n)])
    return [c["outcome"] for c in sim.state.calls], results


def test_fault_injection_is_seeded_and_reproducible():
    faults = FaultConfig(timeout=0.15, rate_limit=0.15, partial=0.2, edge_case=0.2)
    a, results_a = _outcomes(7, "ep-1", faults)
    b, results_b = _outcomes(7, "ep-1", faults)
    assert a == b and results_a == results_b  # same seed and episode: identical replay
    assert _outcomes(8, "ep-1", faults)[0] != a and _outcomes(7, "ep-2", faults)[0] != a
    assert {"ok", "timeout", "rate_limited", "partial", "edge_case"} <= set(a)
    for outcome, result in zip(a, results_a, strict=True):
        if outcome == "timeout":
            assert result["error"] == "timeout"
        elif outcome == "rate_limited":
            assert result["error"] == "rate_limited" and 1 <= result["retry_after_s"] <= 30
        elif outcome == "partial":
            assert result["partial"] is True
        elif outcome == "edge_case":
            assert result["items"] == [] and result["note"] == "no matching records found"


def test_faults_occur_at_the_configured_rates():
    """Over 3000 seeded calls each outcome's count lies in its binomial 99.9% interval (z = 3.29)."""
    rates = {"timeout": 0.1, "rate_limited": 0.05, "edge_case": 0.15, "partial": 0.2}
    faults = FaultConfig(timeout=0.1, rate_limit=0.05, edge_case=0.15, partial=0.2)
    n = 3000
    sim = ToolSimulator(TOOLS, seed=11, episode_id="rates", faults=faults)
    calls = [_call("search_tickets", {"query": "x"}), _call("delete_ticket", {"ticket_id": "T-0"})]

    async def play():
        for i in range(n):
            await sim.execute(calls[i % 2])

    asyncio.run(play())
    outcomes = [c["outcome"] for c in sim.state.calls]
    searches, deletes = outcomes[0::2], outcomes[1::2]
    # (outcomes, outcome, probability): a partial result truncates a call that ran, so deletes of a missing
    # ticket answer not_found whenever no stopping fault hit them.
    expected = [(outcomes, "timeout", rates["timeout"]), (outcomes, "rate_limited", rates["rate_limited"]),
                (outcomes, "edge_case", rates["edge_case"]), (searches, "partial", rates["partial"]),
                (searches, "ok", 0.5), (deletes, "not_found", 0.7), (deletes, "partial", 0.0)]
    for seen, outcome, p in expected:
        m, k = len(seen), seen.count(outcome)
        half = 3.29 * (m * p * (1 - p)) ** 0.5
        assert abs(k - m * p) <= half, (outcome, k, m * p, half)


def test_fault_probabilities_are_respected():
    always_timeout, _ = _outcomes(0, "e", FaultConfig(timeout=1.0, rate_limit=0, partial=0, edge_case=0), n=10)
    assert always_timeout == ["timeout"] * 10
    never, _ = _outcomes(0, "e", NO_FAULTS, n=10)
    assert never == ["ok"] * 10
    sim = ToolSimulator(TOOLS, seed=0, episode_id="e", faults=FaultConfig(timeout=1.0, rate_limit=0, partial=0,
                                                                          edge_case=0))
    _run(sim, [_call("create_ticket", {"title": "t", "priority": 1})])
    assert sim.state.created == {}  # a timed-out call changes nothing
    with pytest.raises(ValueError):
        FaultConfig(timeout=1.5)
    crowded = FaultConfig(timeout=0.5, rate_limit=0.3, partial=0.3, edge_case=0.3)  # sums past 1: in order
    assert [crowded.pick(u) for u in (0.49, 0.5, 0.79, 0.8, 0.999)] == ["timeout", "rate_limited", "rate_limited",
                                                                      "edge_case", "edge_case"]  # no room left
    assert [NO_FAULTS.pick(u) for u in (0.0, 0.5)] == [None, None]


def test_fake_value_is_deterministic():
    assert fake_value(RETURNS, random.Random(1)) == fake_value(RETURNS, random.Random(1))


def test_user_simulator_personas_and_ending():
    assert pick_persona(0, "ep") == pick_persona(0, "ep")
    assert len({pick_persona(0, f"ep{i}") for i in range(30)}) > 3
    user = UserSimulator(ScriptedModel(), PERSONAS[0], "book a table for two")
    first = asyncio.run(user.next_message([]))
    assert first == "Hi, please help: book a table for two"
    convo = [{"role": "user", "content": first}, {"role": "assistant", "content": "Done, table booked."}]
    assert asyncio.run(user.next_message(convo)) is None  # the scripted user ends after one answer
    view = user._view(convo)
    assert view[0]["role"] == "system" and PERSONAS[0].style in view[0]["content"]
    assert [m["role"] for m in view[1:]] == ["assistant", "user"]  # roles swapped for the simulator
