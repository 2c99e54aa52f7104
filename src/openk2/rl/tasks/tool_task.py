"""What a multi-turn tool-use task adds to a `Task`: the tools it declares, a fresh seeded tool world per
episode, an episode verifier that may read the world's final state, and a worked transcript for warm-up.

A `ToolWorld` executes one call at a time (`call(name, arguments) -> str`); a call it cannot serve (an unknown
tool, missing or wrong arguments) raises ValueError, which the episode turns into an error tool message.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Protocol

from openk2.rl.tasks.base import Problem, Task


class ToolWorld(Protocol):
    """The stateful side of one episode: it executes the policy's tool calls."""

    def call(self, name: str, arguments: dict) -> str:
        """The result text of calling `name` with `arguments`; ValueError for a call it cannot serve."""


class ToolTask(Task):
    """A verifiable task whose facts sit behind tools: the RL loop runs it as a multi-turn episode."""

    max_turns: int = 4  # assistant turns per episode (an [[envs]] entry's max_turns overrides it)

    @abstractmethod
    def tools(self) -> list[dict]:
        """The OpenAI function-tool schemas declared to the policy."""

    @abstractmethod
    def world(self, problem: Problem) -> ToolWorld:
        """A fresh tool world for one episode of `problem` (deterministic in the problem)."""

    def verify_episode(self, problem: Problem, final_text: str, world: ToolWorld) -> float:
        """The episode's reward from the final answer (and the world's final state); default: `verify`."""
        return self.verify(problem, final_text)

    @abstractmethod
    def transcript(self, problem: Problem) -> list[dict]:
        """A worked episode as OpenAI messages (user, assistant calls, tool results, answer), for warm-up."""


__all__ = ["ToolTask", "ToolWorld"]
