"""RL iteration time, colocated vs rollout workers on Ray (rollout.placement), on configs/rl-tiny.toml.

Each placement runs the same seeded iterations (a short warm-up: only the timing matters here); reported are
the start-up seconds (warm-up, and for Ray the actors and the weight-sync group) and medians over the
iterations of the rollout, training and weight-sync phases, with the sync's GB/s per receiver.

    python benchmarks/bench_rl_placement.py --iterations 6 --workers 1 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_summary  # noqa: E402

from openk2.rl.config import load_rl_config  # noqa: E402
from openk2.rl.trainer import RLTrainer  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "rl-tiny.toml"


def _median(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else float("nan")


def measure(overrides: list[str], iterations: int) -> dict:
    """Start a trainer with `overrides`, run `iterations`, and return its timing summary."""
    start = time.perf_counter()
    trainer = RLTrainer(load_rl_config(CONFIG, overrides), tempfile.mkdtemp())
    startup = time.perf_counter() - start
    try:
        records = []
        for _ in range(iterations):
            t = time.perf_counter()
            records.append({**trainer.iterate(), "iteration_s": time.perf_counter() - t})
    finally:
        trainer.close()
    return {"startup_s": startup, **{k: _median(records, k) for k in
                                     ("iteration_s", "rollout_s", "train_s", "sync_s", "sync_gb_s")},
            "tokens": sum(r["new_tokens"] for r in records)}


def main() -> None:
    """Print one table row per placement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--warmup-steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = [f"warmup.steps={args.warmup_steps}", "train.threads=1"]
    runs = {"colocated": base}
    for n in args.workers:
        runs[f"ray, {n} worker(s)"] = base + ["rollout.placement='ray'", f"rollout.num_workers={n}"]
    if args.workers:
        import ray

        ray.init(include_dashboard=False, log_to_driver=False)
    print(machine_summary())
    print("| placement | start-up s | s / iteration | rollout s | train s | sync s | sync GB/s | tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for name, overrides in runs.items():
        r = measure(overrides, args.iterations)
        print(f"| {name} | {r['startup_s']:.1f} | {r['iteration_s']:.2f} | {r['rollout_s']:.2f} | "
              f"{r['train_s']:.2f} | {r['sync_s']:.4f} | {r['sync_gb_s']:.2f} | {r['tokens']} |", flush=True)


if __name__ == "__main__":
    main()
