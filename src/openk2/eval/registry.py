"""Benchmark names -> `Benchmark` objects, imported lazily so `openk2 eval --list` stays cheap.

`get("rl:<task>")` evaluates any registered verifiable RL task (`openk2.rl.tasks`) on held-out seeds, at every
difficulty in turn; `get("rl:<task>@<level>")` at one difficulty (the level an RL run trained on, say).
Add your own with `register(name, factory)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from openk2.eval.base import Benchmark

# name -> ("module:factory", constructor keywords)
_BUILTIN: dict[str, tuple[str, dict[str, Any]]] = {
    "tau2-retail": ("openk2.eval.tau2:Tau2Benchmark", {"domain": "retail"}),
    "tau2-airline": ("openk2.eval.tau2:Tau2Benchmark", {"domain": "airline"}),
    # telecom needs user-side tools, which only tau2's own runner simulates
    "tau2-telecom": ("openk2.eval.tau2_runner:Tau2RunnerBenchmark", {"domain": "telecom"}),
    "bfcl-simple": ("openk2.eval.bfcl:BFCLBenchmark", {"category": "simple"}),
    "bfcl-multiple": ("openk2.eval.bfcl:BFCLBenchmark", {"category": "multiple"}),
    "bfcl-parallel": ("openk2.eval.bfcl:BFCLBenchmark", {"category": "parallel"}),
    "bfcl-parallel-multiple": ("openk2.eval.bfcl:BFCLBenchmark", {"category": "parallel_multiple"}),
    "bfcl-irrelevance": ("openk2.eval.bfcl:BFCLBenchmark", {"category": "irrelevance"}),
    **{f"bfcl-live-{c.replace('_', '-')}": ("openk2.eval.bfcl:BFCLBenchmark", {"category": f"live_{c}"})
       for c in ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance", "relevance")},
    "bfcl-multi-turn": ("openk2.eval.bfcl_multi_turn:BFCLMultiTurnBenchmark", {}),
    **{f"bfcl-multi-turn-{c.replace('_', '-')}": ("openk2.eval.bfcl_multi_turn:BFCLMultiTurnBenchmark",
                                                  {"category": c})
       for c in ("miss_func", "miss_param", "long_context")},
    "humaneval": ("openk2.eval.humaneval:HumanEvalBenchmark", {}),
    "gsm-symbolic": ("openk2.eval.tasks:TaskBenchmark", {"task": "rg:gsm_symbolic", "bench_name": "gsm-symbolic"}),
    "math": ("openk2.eval.tasks:TaskBenchmark", {"task": "math", "bench_name": "math"}),
    "instruction": ("openk2.eval.tasks:TaskBenchmark", {"task": "instruction", "bench_name": "instruction"}),
    "perplexity": ("openk2.eval.perplexity:PerplexityBenchmark", {}),
}
_USER: dict[str, Callable[..., Benchmark]] = {}
_RL_PREFIX = "rl:"


def register(name: str, factory: Callable[..., Benchmark]) -> None:
    """Make `get(name)` return `factory()`; a user benchmark may replace a built-in one."""
    if not name or name.startswith(_RL_PREFIX) or "," in name:
        raise ValueError(f"benchmark name {name!r} must be non-empty, contain no comma and not start with 'rl:'")
    _USER[name] = factory


def names() -> list[str]:
    """Registered benchmark names (any RL task is reachable as 'rl:<task>' on top)."""
    return sorted(set(_BUILTIN) | set(_USER))


def describe() -> list[tuple[str, str]]:
    """(name, one-line description) for every registered benchmark, importing each module once."""
    rows = []
    for name in names():
        try:
            rows.append((name, get(name).description))
        except Exception as exc:  # a missing optional package must not hide the other benchmarks
            rows.append((name, f"(unavailable: {exc})"))
    return rows


def get(name: str, **kwargs: Any) -> Benchmark:
    """The benchmark registered as `name`."""
    if name.startswith(_RL_PREFIX):
        from openk2.eval.tasks import TaskBenchmark

        task, at, level = name[len(_RL_PREFIX):].partition("@")
        if at:
            if not level.isdigit():
                raise ValueError(f"benchmark {name!r}: the difficulty after '@' must be a whole number")
            kwargs = {"difficulty": int(level), **kwargs}
        return TaskBenchmark(task=task, bench_name=name, **kwargs)
    if name in _USER:
        return _USER[name](**kwargs)
    if name not in _BUILTIN:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(names())} (and rl:<task>)")
    target, defaults = _BUILTIN[name]
    module, _, attr = target.partition(":")
    factory = getattr(importlib.import_module(module), attr)
    return factory(**{**defaults, **kwargs})
