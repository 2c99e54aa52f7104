"""Gym-like RL environments (report 3.2.1): `reset(seed) -> Observation`, `step(action) -> (obs, reward, done,
info)`. An observation is the conversation so far plus the tools on offer, so a chat policy consumes it as is.

- `TaskEnv`: one verifiable task, single turn. The first assistant message ends the episode with the
  verifier's reward.
- `ToolEnv`: the same task, multi-turn. Assistant messages with `tool_calls` run the tools and continue;
  the first message without tool calls is graded. Out of turns means reward 0.
- `make_env(name)`: a `TaskEnv` for any registered task, including reasoning-gym datasets as 'rg:<name>'.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from openk2.rl import tasks
from openk2.rl.tasks.base import Problem, Task


@dataclass
class Observation:
    """What the policy sees: OpenAI-style `messages` and `tools` (function schemas)."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)


@dataclass
class Tool:
    """A tool the policy may call: its schema fields and `fn(**arguments) -> str`."""

    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any]

    def schema(self) -> dict:
        """The OpenAI function-tool schema."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


Action = str | dict


class Env(ABC):
    """The Gym-like interface every environment implements."""

    @abstractmethod
    def reset(self, seed: int) -> Observation:
        """Start an episode; deterministic in `seed`."""

    @abstractmethod
    def step(self, action: Action) -> tuple[Observation, float, bool, dict]:
        """Apply one assistant turn (text, or an assistant message dict with optional `tool_calls`)."""


class TaskEnv(Env):
    """A single-turn environment around a verifiable `Task` at a fixed difficulty."""

    def __init__(self, task: Task, difficulty: int = 1, system_prompt: str | None = None):
        self.task, self.difficulty, self.system_prompt = task, difficulty, system_prompt
        self.problem: Problem | None = None
        self._messages: list[dict] = []
        self._done = True

    def reset(self, seed: int) -> Observation:
        self.problem = self.task.generate(seed, self.difficulty)
        self._messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        self._messages.append({"role": "user", "content": self.problem.prompt})
        self._done = False
        return self._observation()

    def step(self, action: Action) -> tuple[Observation, float, bool, dict]:
        message = self._begin_step(action)
        self._messages.append(message)
        return self._finish(message.get("content") or "")

    def _begin_step(self, action: Action) -> dict:
        if self._done or self.problem is None:
            raise ValueError("step() called on a finished episode; call reset(seed) first")
        if isinstance(action, str):
            return {"role": "assistant", "content": action}
        if not isinstance(action, dict):
            raise ValueError(f"action must be a string or an assistant message dict, got {type(action).__name__}")
        return {"role": "assistant", **{k: v for k, v in action.items() if k != "role"}}

    def _finish(self, text: str, reward: float | None = None) -> tuple[Observation, float, bool, dict]:
        assert self.problem is not None
        self._done = True
        if reward is None:
            reward = float(self.task.verify(self.problem, text))
        info = {"task": self.task.name, "problem": self.problem, "response": text}
        return self._observation(), reward, True, info

    def _observation(self) -> Observation:
        return Observation(messages=list(self._messages))


class ToolEnv(TaskEnv):
    """A multi-turn environment: the policy may call `tools` for up to `max_turns` turns, then answers.

    `tools` is a fixed list or a function of the problem (e.g. a lookup tool over that problem's tables).
    Tool errors are returned to the policy as the tool's output, as a real tool server would.
    """

    def __init__(self, task: Task, tools: Sequence[Tool] | Callable[[Problem], Sequence[Tool]],
                 difficulty: int = 1, max_turns: int = 8, system_prompt: str | None = None):
        super().__init__(task, difficulty, system_prompt)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self._tool_source, self.max_turns = tools, max_turns
        self._tools: dict[str, Tool] = {}
        self._turns = 0

    def reset(self, seed: int) -> Observation:
        super().reset(seed)
        assert self.problem is not None
        tools = self._tool_source(self.problem) if callable(self._tool_source) else self._tool_source
        self._tools = {tool.name: tool for tool in tools}
        self._turns = 0
        return self._observation()

    def step(self, action: Action) -> tuple[Observation, float, bool, dict]:
        message = self._begin_step(action)
        self._messages.append(message)
        self._turns += 1
        calls = message.get("tool_calls") or []
        if not calls:
            return self._finish(message.get("content") or "")
        for call in calls:
            self._messages.append({"role": "tool", "tool_call_id": call.get("id", ""),
                                   "content": self._run_tool(call)})
        if self._turns >= self.max_turns:
            return self._finish("", reward=0.0)
        return self._observation(), 0.0, False, {"task": self.task.name, "turn": self._turns}

    def _run_tool(self, call: dict) -> str:
        function = call.get("function", {})
        tool = self._tools.get(function.get("name", ""))
        if tool is None:
            return f"error: unknown tool {function.get('name')!r}"
        try:
            arguments = function.get("arguments") or "{}"
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            return str(tool.fn(**arguments))
        except Exception as e:  # noqa: BLE001 - any tool failure is the policy's to see, not a crash
            return f"error: {type(e).__name__}: {e}"

    def _observation(self) -> Observation:
        return Observation(messages=list(self._messages), tools=[t.schema() for t in self._tools.values()])


def make_env(name: str, difficulty: int = 1, system_prompt: str | None = None, **task_kwargs: Any) -> TaskEnv:
    """A single-turn environment for the registered task `name` ('rg:<dataset>' for reasoning-gym)."""
    return TaskEnv(tasks.get(name, **task_kwargs), difficulty, system_prompt)
