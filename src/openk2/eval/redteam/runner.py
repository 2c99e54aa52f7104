"""Run the plugin x strategy grid and record every attempt: `run_redteam`.

Layout of a red-team directory:

    OUT/settings.json    the models and settings the records were made with
    OUT/attempts.jsonl   one record per attempt: cell, goal, seed, conversation, rounds, verdict, judge output
    OUT/results.json     pass rate per cell, per plugin, per strategy and overall (Wilson 95% intervals)
    OUT/table.md         the plugin x strategy table
    OUT/heatmap.png      the same as a heatmap

Attempt `i` of a cell attacks the cell plugin's goal `i mod #goals`; its seed depends only on the run seed and
the attempt id (`plugin/strategy/i`), so results do not depend on order or concurrency. Each record is appended
and flushed as soon as its attempt ends: an interrupted run loses only the attempts in flight, and rerunning
the same command does only what is missing (attempts that raised are retried). Records made with other models
or settings are never mixed in: the run refuses to resume over them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from openk2.eval.base import EvalContext
from openk2.eval.records import claim_directory, drop_partial_line, read_records
from openk2.eval.redteam.plugins import Goal, goals_for, plugin_names
from openk2.eval.redteam.report import write_report
from openk2.eval.redteam.strategies import AttackSettings, Roles, get_strategy, strategy_names
from openk2.progress import progress_bar

ATTEMPTS_FILE = "attempts.jsonl"


@dataclass(frozen=True)
class AttemptSpec:
    """One attempt of the grid: which cell, which goal, which seed."""

    id: str
    plugin: str
    strategy: str
    index: int
    goal: Goal
    seed: int


def plan_attempts(plugins: Sequence[str], strategies: Sequence[str], per_cell: int, seed: int) -> list[AttemptSpec]:
    """Every attempt of the grid, plugin-major, in a fixed order."""
    if per_cell < 1:
        raise ValueError(f"per_cell must be >= 1, got {per_cell}")
    for name in strategies:
        get_strategy(name)  # unknown names fail here, before any model runs
    ctx = EvalContext(seed=seed)
    specs = []
    for plugin in plugins:
        goals = goals_for(plugin)
        for strategy in strategies:
            for i in range(per_cell):
                attempt_id = f"{plugin}/{strategy}/{i}"
                specs.append(AttemptSpec(attempt_id, plugin, strategy, i, goals[i % len(goals)],
                                         ctx.sample_seed(attempt_id)))
    return specs


def run_attempt(spec: AttemptSpec, roles: Roles, settings: AttackSettings) -> dict[str, Any]:
    """Run one attempt and return its record; an exception (a model or endpoint failure) becomes an error record."""
    start = time.perf_counter()
    record: dict[str, Any] = {"id": spec.id, "plugin": spec.plugin, "strategy": spec.strategy,
                              "attempt": spec.index, "goal": spec.goal.id, "seed": spec.seed}
    try:
        result = get_strategy(spec.strategy)(spec.goal, roles, settings, spec.seed)
    except Exception as exc:  # noqa: BLE001 - recorded, excluded from the rates, retried on resume
        record.update(verdict=None, error=f"{type(exc).__name__}: {exc}")
    else:
        judgement = result.judgement
        record.update(verdict=judgement.verdict, passed=judgement.passed, judge_method=judgement.method,
                      judge_reason=judgement.reason, judge_raw=judgement.raw, conversation=result.conversation,
                      rounds=result.rounds)
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def run_redteam(roles: Roles, out_dir: str | Path, *, plugins: Sequence[str] | None = None,
                strategies: Sequence[str] | None = None, per_cell: int = 2, seed: int = 0,
                settings: AttackSettings | None = None, concurrency: int = 1, progress: bool = True,
                heatmap: bool = True) -> dict:
    """Attack `roles.target` on every plugin x strategy cell, `per_cell` attempts each; returns results.json's
    payload (see the module docstring for the files written; `heatmap=False` skips the PNG)."""
    plugins = list(plugins or plugin_names())
    strategies = list(strategies or strategy_names())
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    settings = settings or AttackSettings()
    specs = plan_attempts(plugins, strategies, per_cell, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_settings = {"target": _name(roles.target), "attacker": _name(roles.attacker), "judge": _name(roles.judge),
                    "seed": seed, **asdict(settings)}
    claim_directory(out, run_settings)
    path = out / ATTEMPTS_FILE
    drop_partial_line(path)
    done = {r["id"]: r for r in read_records(path) if r.get("verdict") is not None}
    todo = [s for s in specs if s.id not in done]
    bar = progress_bar(len(specs), "redteam", "attempt", initial=len(specs) - len(todo), enabled=progress)
    with open(path, "a", encoding="utf-8") as sink:
        def record(rec: dict[str, Any]) -> None:
            sink.write(json.dumps(rec, ensure_ascii=False) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
            if rec.get("verdict") is not None:
                done[rec["id"]] = rec
            bar.update(1)
            judged = [r for r in done.values() if r.get("verdict")]
            bar.set_postfix(pass_rate=f"{sum(r['passed'] for r in judged) / max(1, len(judged)):.2f}")

        if concurrency == 1 or len(todo) <= 1:
            for spec in todo:
                record(run_attempt(spec, roles, settings))
        else:
            with ThreadPoolExecutor(concurrency) as pool:
                for fut in as_completed([pool.submit(run_attempt, s, roles, settings) for s in todo]):
                    record(fut.result())
    bar.close()
    wanted = [done[s.id] for s in specs if s.id in done]
    failed = len(specs) - len(wanted)
    if failed:
        errors = {r.get("error") for r in read_records(path) if r.get("verdict") is None}
        print(f"redteam: {failed} attempt(s) raised and are left out of the rates (rerun to retry): "
              f"{'; '.join(sorted(str(e) for e in errors))[:500]}")
    return write_report(out, wanted, plugins, strategies, run_settings, errors=failed, heatmap=heatmap)


def _name(model: Any) -> str:
    return str(getattr(model, "name", type(model).__name__))
