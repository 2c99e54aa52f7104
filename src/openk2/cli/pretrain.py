"""`openk2 pretrain --config FILE [--out DIR] [--max-steps N] [--resume] [--export-hf DIR] [--set key=value ...]`."""

from __future__ import annotations

import argparse
import os
import sys

from openk2.cli.args import add_resume_argument, add_set_argument, positive_int
from openk2.train.config import load_run_config


def pretrain_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="openk2 pretrain", description="Pre-train a K2-style model with MuonClip")
    parser.add_argument("--config", help="TOML run config (configs/tiny.toml); defaults apply when omitted")
    parser.add_argument("--out", help="run directory (default: out_dir from the config)")
    parser.add_argument("--max-steps", type=positive_int, help="stop after this step without changing the schedule")
    parser.add_argument("--export-hf", metavar="DIR",
                        help="after the run, write the final checkpoint's model as HF safetensors into DIR "
                             "(streamed from its DCP shards; what a parallel run needs for transformers/local:)")
    add_resume_argument(parser)
    add_set_argument(parser)
    args = parser.parse_args(argv)
    cfg = load_run_config(args.config, args.set)

    from openk2.train.checkpoint import CheckpointWriteError
    from openk2.train.trainer import BadStepError, Trainer

    trainer_cls = Trainer
    if cfg.parallel.enabled or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun
        from openk2.train.parallel.trainer import ParallelTrainer as trainer_cls
    trainer = trainer_cls(cfg, out_dir=args.out, resume=args.resume)
    try:
        summary = trainer.run(max_steps=args.max_steps)
    except (BadStepError, CheckpointWriteError) as err:  # a full disk too: one line, the last checkpoint kept
        print(f"openk2 pretrain: {err}", file=sys.stderr)
        return 1
    if not trainer.is_main:  # rank 0 reports for the whole job
        return 0
    print(f"\nrun directory: {summary.out_dir}")
    print(f"  step {summary.step}, {summary.tokens_per_s:,.0f} tokens/s (last window)")
    if summary.val_loss is not None:
        print(f"  validation loss {summary.val_loss:.4f} nats/token; unigram baseline {summary.unigram_val_loss:.4f}")
    print(f"  checkpoint: {summary.checkpoint}")
    if args.export_hf and summary.checkpoint is not None:
        from openk2.train.hf_export import export_hf

        export_hf(summary.checkpoint, args.export_hf)
        print(f"  HF export:  {args.export_hf}")
    print(f"  metrics:    {summary.out_dir / 'metrics.jsonl'}")
    for plot in summary.plots:
        print(f"  plot:       {plot}")
    return 0
