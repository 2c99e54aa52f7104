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


def test_state_tracks_created_changed_deleted_and_faker_fits_schema():
    sim = ToolSimulator(TOOLS, seed=3, episode_id="e", faults=NO_FAULTS)
    created, deleted, searched = _run(sim, [_call("create_ticket", {"title": "printer", "priority": 2}),
                                            _call("delete_ticket", {"ticket_id": "T-9"}),
                                            _call("search_tickets", {"query": "printer"})])
    for result in (created, deleted, searched):
        assert value_problems(result, RETURNS) == []
    assert sim.state.created == {"create_ticket#0": {"title": "printer", "priority": 2}}
    assert sim.state.deleted == ["T-9"]
    assert [c["outcome"] for c in sim.state.calls] == ["ok", "ok", "ok"]


def test_model_simulated_results_and_effects():
    sim = ToolSimulator(TOOLS, seed=0, episode_id="e", faults=NO_FAULTS, model=ScriptedModel())
    (got,) = _run(sim, [_call("search_tickets", {"query": "q"})])
    assert got == {"status": "ok", "items": ["a", "b", "c", "d"]}
    assert sim.state.created == {"search_tickets-record": {"ok": True}}


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
            assert result["matches"] == [] and result["note"] == "no matching records found"


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
