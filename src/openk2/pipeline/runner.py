"""Walk the stages in order: skip the finished ones, run (or resume) the rest, time each, and write the report.

Rules, in order of precedence:
- `force` names stages to redo from scratch: they and every stage downstream of them lose their directories.
- A stage whose input ran in this invocation is stale: its directory is removed before it runs.
- A stage with a `DONE` manifest is skipped, unless its config fingerprint changed (then it is an error, naming
  the `--force` that redoes it: silently mixing outputs of two configs would make the report lie).
- Any other stage runs; training stages resume from their newest complete checkpoint.

Every invocation appends one record per stage to `out_dir/pipeline.jsonl` (ran / skipped / failed / reset, wall
and CPU seconds), so interrupted and resumed attempts stay visible.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openk2.pipeline.config import PipelineConfig
from openk2.pipeline.stages import LOG_FILE, Stage, build_stages, downstream


@dataclass
class StageOutcome:
    name: str
    status: str  # "ran" or "skipped" (a failure raises)
    wall_s: float
    cpu_s: float
    manifest: dict[str, Any] = field(default_factory=dict)


@dataclass
class PipelineResult:
    out_dir: Path
    outcomes: list[StageOutcome]
    report: Path | None


def cpu_seconds() -> float:
    """User + system CPU time of this process (all its threads) and of its finished child processes."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_pipeline(cfg: PipelineConfig, out_dir: str | Path | None = None, force: Iterable[str] = (),
                 write_report: bool = True) -> PipelineResult:
    """Run every stage of `cfg` that has not finished yet; `force` names stages to redo with all downstream."""
    out = Path(out_dir or cfg.out_dir)
    stages = build_stages(cfg, out)
    names = [s.name for s in stages]
    force = set(force)
    if "all" in force:
        force = set(names)
    if "eval" in force:
        force = (force - {"eval"}) | {n for n in names if n.startswith("eval-")}
    unknown = sorted(force - set(names))
    if unknown:
        raise ValueError(f"--force: unknown stage(s) {', '.join(unknown)}; stages: {', '.join(names)}, eval, all")
    out.mkdir(parents=True, exist_ok=True)
    redo = downstream(stages, force)
    for stage in stages:
        if stage.name in redo:
            stage.reset()
            _log(out, stage.name, "reset")

    outcomes: list[StageOutcome] = []
    ran: set[str] = set()
    for index, stage in enumerate(stages, 1):
        header = f"[pipeline {index}/{len(stages)}] {stage.name}"
        stale = any(i in ran for i in stage.inputs)
        manifest = stage.manifest()
        if stale and stage.directory.exists():
            print(f"{header}: inputs changed in this run; starting it afresh", file=sys.stderr)
            stage.reset()
            _log(out, stage.name, "reset")
        elif manifest is not None:
            _check_fingerprint(stage, manifest)
            print(f"{header}: done ({manifest['finished_at']}), skipped", file=sys.stderr)
            outcomes.append(StageOutcome(stage.name, "skipped", 0.0, 0.0, manifest))
            _log(out, stage.name, "skipped")
            continue
        print(f"{header}: running", file=sys.stderr)
        outcome = _run_stage(out, stage)
        print(f"{header}: finished in {outcome.wall_s:.1f} s wall, {outcome.cpu_s:.1f} s CPU", file=sys.stderr)
        outcomes.append(outcome)
        ran.add(stage.name)

    report = None
    if write_report:
        from openk2.pipeline.report import write_report as _write

        report = _write(out, stages)
        print(f"report: {report}", file=sys.stderr)
    return PipelineResult(out, outcomes, report)


def _run_stage(out: Path, stage: Stage) -> StageOutcome:
    stage.directory.mkdir(parents=True, exist_ok=True)
    wall0, cpu0, load0 = time.perf_counter(), cpu_seconds(), os.getloadavg()[0]
    try:
        info = stage.body()
    except BaseException as err:  # KeyboardInterrupt included: the attempt is logged, then the error goes on
        _log(out, stage.name, "failed", wall_s=time.perf_counter() - wall0, cpu_s=cpu_seconds() - cpu0,
             error=f"{type(err).__name__}: {err}")
        raise
    wall_s, cpu_s = time.perf_counter() - wall0, cpu_seconds() - cpu0
    info["load_average"] = [round(load0, 2), round(os.getloadavg()[0], 2)]  # 1-min, at start and end: how shared
    manifest = stage.mark_done(wall_s, cpu_s, info)
    _log(out, stage.name, "ran", wall_s=wall_s, cpu_s=cpu_s, resumed_from=info.get("resumed_from"))
    return StageOutcome(stage.name, "ran", wall_s, cpu_s, manifest)


def _check_fingerprint(stage: Stage, manifest: dict[str, Any]) -> None:
    if manifest.get("fingerprint") != stage.fingerprint:
        raise ValueError(f"stage {stage.name} in {stage.directory} was run with a different configuration; "
                         f"redo it with --force {stage.name}, or use another --out")


def _log(out: Path, stage: str, status: str, **fields: Any) -> None:
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stage": stage, "status": status, **fields}
    with (out / LOG_FILE).open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")


__all__ = ["LOG_FILE", "PipelineResult", "StageOutcome", "cpu_seconds", "run_pipeline"]
