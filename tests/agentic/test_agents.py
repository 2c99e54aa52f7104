"""Agents (system prompt + sampled toolset) and rubric tasks from simple to complex."""

from __future__ import annotations

import asyncio
import json

import pytest

from openk2.agentic.agents import Agent, Rubric, Task, make_agent, make_tasks, sample_toolsets, template_prompt
from openk2.agentic.jsonout import JSONStats
from openk2.agentic.tools import Tool
from openk2.llm.base import ChatModel, ChatResponse
from tests.agentic.fake_models import ScriptedModel


def _tools():
    out = []
    for domain in ("bank", "shop", "robot"):
        for verb in ("get", "create", "delete"):
            out.append(Tool(name=f"{verb}_{domain}_thing", description=f"{verb} a {domain} thing", source="synthetic",
                            domain=domain, parameters={"type": "object", "properties": {}}))
    return out


def test_toolsets_are_seeded_and_mostly_from_one_domain():
    tools = _tools()
    a = sample_toolsets(tools, 6, 3, seed=1)
    assert a == sample_toolsets(tools, 6, 3, seed=1)
    assert a != sample_toolsets(tools, 6, 3, seed=2)
    assert [domain for domain, _ in a] == ["bank", "robot", "shop", "bank", "robot", "shop"]
    for domain, chosen in a:
        assert len(chosen) == 3 and len({t.name for t in chosen}) == 3
        assert sum(t.domain == domain for t in chosen) == 2  # two from the anchor domain, one distractor
    with pytest.raises(ValueError):
        sample_toolsets([], 1, 3, seed=0)


def test_agent_prompt_from_model_and_template_fallback():
    tools = _tools()[:3]
    agent = asyncio.run(make_agent(ScriptedModel(), "a0", "bank", tools, seed=0))
    assert agent.system_prompt.startswith("You are a careful assistant")
    assert agent.tool_names == [t.name for t in tools] and agent.domain == "bank"

    class Mute(ChatModel):
        def chat(self, messages, tools=None, **sampling):
            return [ChatResponse(content="I'd rather not.")]

    stats = JSONStats()
    fallback = asyncio.run(make_agent(Mute(), "a0", "bank", tools, seed=0, stats=stats))
    assert fallback.system_prompt == template_prompt("bank", fallback.behaviour, tools)
    assert fallback.behaviour == agent.behaviour  # behaviour is seeded by (seed, agent id)
    assert stats.gave_up == 1
    assert Agent.from_dict(agent.to_dict()) == agent


def test_tasks_with_rubrics():
    tools = _tools()[:3]
    agent = Agent("a0", "You help with banking.", [t.name for t in tools], "concise", "bank")
    tasks = asyncio.run(make_tasks(ScriptedModel(), agent, tools, 3))
    assert [t.task_id for t in tasks] == ["a0-t0", "a0-t1", "a0-t2"]
    task = tasks[1]
    assert task.rubric.expected_tools == ["create_bank_thing"]
    assert [(c.criterion_id, c.mandatory) for c in task.rubric.criteria] == [("c1", True), ("c2", False)]
    assert task.rubric.checkpoints == ["tool called"]
    assert Task.from_dict(json.loads(json.dumps(task.to_dict()))) == task


def test_tasks_naming_unknown_tools_are_dropped():
    tools = _tools()[:2]
    agent = Agent("a1", "p", [t.name for t in tools], "concise", "bank")
    reply = {"tasks": [
        {"instruction": "use a tool it lacks", "rubric": {"success_criteria": ["done"], "expected_tools": ["nope"]}},
        {"instruction": "check my balance", "difficulty": "complex",
         "rubric": {"success_criteria": ["balance reported"], "expected_tools": ["get_bank_thing", "nope"]}}]}

    class Fixed(ChatModel):
        def chat(self, messages, tools=None, **sampling):
            return [ChatResponse(content=json.dumps(reply))]

    (task,) = asyncio.run(make_tasks(Fixed(), agent, tools, 2))
    assert task.instruction == "check my balance" and task.difficulty == "complex"
    assert task.rubric.expected_tools == ["get_bank_thing"]
    assert Rubric.from_dict(task.rubric.to_dict()) == task.rubric


def test_copied_task_template_is_rejected():
    tools = _tools()[:1]
    agent = Agent("a2", "p", [tools[0].name], "concise", "bank")
    parrot = {"tasks": [{"instruction": "what the user asks for, in their words", "difficulty": "simple",
                         "rubric": {"success_criteria": [{"description": "...", "mandatory": True}],
                                    "expected_tools": [tools[0].name], "checkpoints": ["..."]}}]}

    class Parrot(ChatModel):
        def chat(self, messages, tools=None, **sampling):
            return [ChatResponse(content=json.dumps(parrot))]

    stats = JSONStats()
    assert asyncio.run(make_tasks(Parrot(), agent, tools, 1, stats=stats, max_attempts=2)) == []
    assert stats.failures == {"invalid": 2}
