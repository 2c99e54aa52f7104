"""`openk2 pipeline --config configs/pipeline-tiny.toml [--out DIR] [--threads N] [--force STAGE] [--set k=v]`."""

from __future__ import annotations

import argparse
import sys

from openk2.pipeline.config import load_pipeline_config
from openk2.pipeline.runner import run_pipeline
from openk2.pipeline.stages import StageStopped


def pipeline_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="openk2 pipeline",
        description="The whole K2 recipe in one command: tokenizer -> pre-training (MuonClip) -> SFT -> RL, with an "
                    "evaluation after each training stage and a report. Finished stages are skipped; an "
                    "interrupted one resumes from its checkpoint when the command is run again.")
    parser.add_argument("--config", required=True, help="pipeline TOML (configs/pipeline-tiny.toml)")
    parser.add_argument("--out", help="pipeline directory (default: out_dir from the config)")
    parser.add_argument("--threads", type=int, help="torch threads for every stage (overrides `threads`)")
    parser.add_argument("--force", action="append", default=[], metavar="STAGE",
                        help="redo STAGE and everything downstream of it (repeatable; `eval` = every evaluation, "
                             "`all` = everything)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a pipeline key, e.g. --set pretrain.set.train.steps=50 (repeatable)")
    args = parser.parse_args(argv)
    overrides = list(args.set)
    if args.threads is not None:
        if args.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {args.threads}")
        overrides.append(f"threads={args.threads}")
    cfg = load_pipeline_config(args.config, overrides)
    try:
        result = run_pipeline(cfg, args.out, force=args.force)
    except StageStopped as stop:  # Ctrl-C / SIGTERM inside a trainer: its checkpoint is written, no traceback
        print(f"openk2 pipeline: {stop}", file=sys.stderr)
        return 130
    ran = [o.name for o in result.outcomes if o.status == "ran"]
    wall = sum(o.wall_s for o in result.outcomes)
    cpu = sum(o.cpu_s for o in result.outcomes)
    print(f"pipeline {result.out_dir}: ran {', '.join(ran) or 'nothing (every stage was done)'} "
          f"in {wall:.1f} s wall, {cpu:.1f} s CPU", file=sys.stderr)
    print(f"report: {result.report}")
    return 0


__all__ = ["pipeline_main"]
