"""State bytes each rank really holds (parameters, gradients, masters, optimizer) vs `openk2 plan`, per layout.

Usage: python benchmarks/bench_parallel_memory.py [--preset small] [--dps 1 2 4] [--shard zero1|fsdp2] [--ep 1]

Each rank builds its share and the parallel trainer's optimizer, runs one real forward/backward on 1 x 16
random tokens (gloo, one thread per process) and counts the storages of its parameters, their gradients and the
optimizer's masters and state (`openk2.train.parallel.held`), at the states' peak (after backward, before the
step frees the gradients). Printed per rank next to `openk2 plan` (`--states fp32`, or `bf16` with
`--param-dtype bfloat16`: bf16 weights, fp32 gradients and masters).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import run_on_ranks  # noqa: E402

from openk2.config import ModelConfig  # noqa: E402
from openk2.train.config import RunConfig  # noqa: E402
from openk2.train.parallel.config import ParallelConfig  # noqa: E402
from openk2.train.parallel.held import measure_states  # noqa: E402
from openk2.train.parallel.plan import plan  # noqa: E402


def _measure_rank(rank: int, world: int, preset: str, parallel: dict) -> dict:
    return measure_states(ModelConfig.preset(preset), ParallelConfig(**parallel), torch.device("cpu"))


def measure(preset: str, parallel: dict) -> dict[int, dict]:
    """{rank: held bytes} for one layout, on ParallelConfig(**parallel).world_size processes."""
    return run_on_ranks(ParallelConfig(**parallel).world_size, _measure_rank, preset, parallel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--shard", default="zero1", choices=["zero1", "fsdp2"], help="parallel.shard")
    parser.add_argument("--ep", type=int, default=1, help="parallel.ep (world = dp x ep)")
    args = parser.parse_args()
    states = "bf16" if args.param_dtype == "bfloat16" else "fp32"
    rows = []
    print(f"preset {args.preset}, parallel.param_dtype {args.param_dtype}, parallel.shard {args.shard}, "
          f"parallel.ep {args.ep}, torch {torch.__version__}; MB per rank")
    print(f"{'dp':>3} {'rank':>4} {'params':>9} {'grads':>9} {'master':>9} {'optim':>9} {'measured':>9} "
          f"{'plan':>9} {'plan/measured':>13}")
    for dp in args.dps:
        parallel = {"dp": dp, "ep": args.ep, "param_dtype": args.param_dtype, "shard": args.shard}
        held = measure(args.preset, parallel)
        planned = plan(RunConfig.from_dict({"model": {"preset": args.preset}, "parallel": parallel}),
                       states=states, device_type="cpu")["per_rank"]
        for row in planned:
            got = held[row["rank"]]
            want = row["params_bytes"] + row["grads_bytes"] + row["master_bytes"] + row["optimizer_bytes"]
            print(f"{dp:>3} {row['rank']:>4} {got['params'] / 1e6:9.2f} {got['grads'] / 1e6:9.2f} "
                  f"{got['master'] / 1e6:9.2f} {got['optimizer'] / 1e6:9.2f} {got['total'] / 1e6:9.2f} "
                  f"{want / 1e6:9.2f} {want / got['total']:13.4f}")
            rows.append({"dp": dp, "rank": row["rank"], "measured": got, "planned": want})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
