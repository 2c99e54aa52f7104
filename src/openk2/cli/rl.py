"""`openk2 rl`: colocated RL with partial rollout on a weighted mixture of verifiable tasks (configs/rl-tiny.toml)."""

from __future__ import annotations

import argparse
import sys

from openk2.cli.args import add_resume_argument, add_set_argument, positive_int
from openk2.rl.config import load_rl_config
from openk2.rl.placement import RolloutWorkerError
from openk2.rl.trainer import RLTrainer


def rl_main(argv: list[str] | None = None) -> int:
    """`openk2 rl --config configs/rl-tiny.toml [--set section.key=value ...] [--resume]`."""
    parser = argparse.ArgumentParser(
        prog="openk2 rl", description="Colocated RL (K1.5 loss, partial rollout, checkpoint-engine weight sync) "
                                      "on a mixture of verifiable tasks ([[envs]], else [task]), after a short "
                                      "supervised warm-up")
    parser.add_argument("--config", help="RL TOML config (e.g. configs/rl-tiny.toml)")
    add_set_argument(parser, "train.iterations=60")
    parser.add_argument("--out-dir", help="run directory (default: the config's out_dir)")
    add_resume_argument(parser)
    parser.add_argument("--max-iterations", type=positive_int, help="stop after this many more iterations")
    args = parser.parse_args(argv)
    cfg = load_rl_config(args.config, args.set)
    try:
        trainer = RLTrainer(cfg, args.out_dir, resume=args.resume)
        try:
            summary = trainer.run(args.max_iterations)
        finally:
            trainer.close()  # rollout.placement = "ray": stop the workers
    except RolloutWorkerError as err:  # a lost Ray worker: one line, no traceback (checkpoints are kept)
        print(f"openk2 rl: error: {err} (rerun with --resume)", file=sys.stderr)
        return 1
    first, last = summary.first_eval or {}, summary.last_eval or {}
    nan = float("nan")
    print(f"iteration {summary.iteration}: held-out reward (greedy) {first.get('eval_reward', nan):.3f} -> "
          f"{last.get('eval_reward', nan):.3f}, sampled at T=1 {first.get('eval_reward_sampled', nan):.3f} -> "
          f"{last.get('eval_reward_sampled', nan):.3f}")
    print(f"checkpoint: {summary.checkpoint}\ncurves: {summary.plot}")
    return 0
