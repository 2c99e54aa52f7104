"""`openk2 pretrain --config FILE [--out DIR] [--max-steps N] [--resume] [--set key=value ...]`."""

from __future__ import annotations

import argparse
import os
import sys

from openk2.cli.args import add_resume_argument, add_set_argument
from openk2.train.config import load_run_config


def pretrain_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="openk2 pretrain", description="Pre-train a K2-style model with MuonClip")
    parser.add_argument("--config", help="TOML run config (configs/tiny.toml); defaults apply when omitted")
    parser.add_argument("--out", help="run directory (default: out_dir from the config)")
    parser.add_argument("--max-steps", type=int, help="stop after this step without changing the schedule")
    add_resume_argument(parser)
    add_set_argument(parser)
    args = parser.parse_args(argv)
    cfg = load_run_config(args.config, args.set)

    from openk2.train.trainer import BadStepError, Trainer

    trainer_cls = Trainer
    if cfg.parallel.enabled or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun
        from openk2.train.parallel.trainer import ParallelTrainer as trainer_cls
    trainer = trainer_cls(cfg, out_dir=args.out, resume=args.resume)
    try:
        summary = trainer.run(max_steps=args.max_steps)
    except BadStepError as err:
        print(f"openk2 pretrain: {err}", file=sys.stderr)
        return 1
    if not trainer.is_main:  # rank 0 reports for the whole job
        return 0
    print(f"\nrun directory: {summary.out_dir}")
    print(f"  step {summary.step}, {summary.tokens_per_s:,.0f} tokens/s (last window)")
    if summary.val_loss is not None:
        print(f"  validation loss {summary.val_loss:.4f} nats/token; unigram baseline {summary.unigram_val_loss:.4f}")
    print(f"  checkpoint: {summary.checkpoint}")
    print(f"  metrics:    {summary.out_dir / 'metrics.jsonl'}")
    for plot in summary.plots:
        print(f"  plot:       {plot}")
    return 0
