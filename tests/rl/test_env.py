import json

import pytest

from openk2.rl.env import Observation, TaskEnv, Tool, ToolEnv, make_env
from openk2.rl.tasks.arithmetic import ArithmeticTask
from openk2.rl.tasks.expr import evaluate


def test_single_turn_task_env():
    env = make_env("arithmetic", difficulty=3, system_prompt="Be brief.")
    obs = env.reset(seed=11)
    assert isinstance(obs, Observation) and obs.tools == []
    assert [m["role"] for m in obs.messages] == ["system", "user"]
    assert obs.messages[1]["content"] == env.problem.prompt
    value = env.problem.data["answer"]
    obs, reward, done, info = env.step(f"Answer: {value}")
    assert (reward, done) == (1.0, True) and info["task"] == "arithmetic" and info["problem"] is env.problem
    assert obs.messages[-1] == {"role": "assistant", "content": f"Answer: {value}"}
    with pytest.raises(ValueError, match="finished episode"):
        env.step("Answer: 0")
    env.reset(seed=11)
    assert env.step({"role": "assistant", "content": f"Answer: {value + 1}"})[1] == 0.0
    assert env.reset(seed=11).messages == env.reset(seed=11).messages  # deterministic in the seed
    with pytest.raises(ValueError, match="reset"):
        TaskEnv(ArithmeticTask()).step("Answer: 1")


def _calculator() -> Tool:
    return Tool("calculator", "Evaluate an arithmetic expression.",
                {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                lambda expression: str(evaluate(expression)[0]))


def _call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def test_multi_turn_tool_env():
    env = ToolEnv(ArithmeticTask(), [_calculator()], difficulty=5, max_turns=3)
    obs = env.reset(seed=4)
    assert obs.tools[0]["function"]["name"] == "calculator"
    obs, reward, done, _ = env.step(_call("calculator", expression=env.problem.data["expression"]))
    assert (reward, done) == (0.0, False)
    assert obs.messages[-1]["role"] == "tool" and obs.messages[-1]["tool_call_id"] == "call_1"
    result = obs.messages[-1]["content"]
    assert int(result) == env.problem.data["answer"]
    obs, reward, done, _ = env.step(_call("nope"))
    assert obs.messages[-1]["content"].startswith("error: unknown tool") and not done
    obs, reward, done, info = env.step(f"Answer: {result}")
    assert (reward, done) == (1.0, True) and len(obs.messages) == 6


def test_tool_errors_and_turn_limit():
    env = ToolEnv(ArithmeticTask(), lambda problem: [_calculator()], max_turns=2)
    env.reset(seed=0)
    obs, _, done, _ = env.step(_call("calculator", expression="1/0"))
    assert "division by zero" in obs.messages[-1]["content"] and not done
    obs, reward, done, _ = env.step(_call("calculator", expression="1+1"))
    assert (reward, done) == (0.0, True)  # out of turns before answering
    with pytest.raises(ValueError):
        ToolEnv(ArithmeticTask(), [], max_turns=0)


def test_reasoning_gym_as_an_environment():
    env = make_env("rg:basic_arithmetic", difficulty=2)
    obs = env.reset(seed=2)
    assert "Calculate" in obs.messages[0]["content"]
    entry = env.problem.data["entry"]
    assert env.step(f"Answer: {entry['answer']}")[1] == 1.0
