"""`openk2 plan --config FILE [--world N] [--states fp32|bf16] [--device cuda|cpu] [--json] [--set k=v ...]`."""

from __future__ import annotations

import argparse
import json

from openk2.cli.args import add_set_argument
from openk2.train.config import load_run_config

GB = 1e9


def plan_main(argv: list[str] | None = None) -> int:
    """Print each rank's device bytes for a run config's parallel layout (nothing is allocated)."""
    parser = argparse.ArgumentParser(prog="openk2 plan", description="Per-rank memory of a parallel run, planned "
                                     "from the model built on the meta device")
    parser.add_argument("--config", required=True, help="TOML run config (configs/kimi-k2-pp16-ep16.toml)")
    parser.add_argument("--world", type=int, help="ranks in all; dp = N / (pp x ep) (default: the config's)")
    parser.add_argument("--states", default=None, choices=("fp32", "bf16"),
                        help="fp32: fp32 weights; bf16: bf16 weights + sharded fp32 master (default: the "
                             "config's parallel.param_dtype)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="attention kernel and precision=auto resolve as on this device type")
    parser.add_argument("--json", action="store_true", help="print JSON (world_size, max_rank_bytes, per_rank)")
    add_set_argument(parser)
    args = parser.parse_args(argv)
    cfg = load_run_config(args.config, args.set)
    from openk2.train.parallel.plan import plan

    result = plan(cfg, args.world, args.states, args.device)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    layout = result["layout"]
    print(f"{args.config}: world {result['world_size']} = pp {layout['pp']} x dp {layout['dp']} x ep {layout['ep']}"
          f" ({layout['pp_schedule']}, {layout['pp_virtual_stages']} stages per rank); states {result['states']}"
          f"; dp sharding {layout['shard']}")
    keys = ("params", "grads", "master", "optimizer", "activation", "comm", "total")
    print(f"{'pp rank':>8}" + "".join(f"{k + ' GB':>14}" for k in keys))
    for row in result["per_rank"][::layout["dp"] * layout["ep"]]:  # dp and ep ranks of a pp rank are alike
        print(f"{row['pp_rank']:>8}" + "".join(f"{row[k + '_bytes'] / GB:>14.2f}" for k in keys))
    print(f"worst rank {result['worst_rank']}: {result['max_rank_bytes'] / GB:.2f} GB")
    return 0
