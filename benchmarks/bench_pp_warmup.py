"""Interleaved 1F1B with extra warm-up micro-batches (parallel.pp_extra_warmup): step time and activation peak.

Usage: python benchmarks/bench_pp_warmup.py [--extras 0 1 2] [--microbatches 4] [--rows 2] [--seq 256]
       [--repeats 9]

Two gloo processes of one thread each (pp = 2, 2 virtual stages, the `tiny` preset: 4 layers, one per stage)
run the pipeline's forward/backward (torch's schedule runtime, no optimizer step) over random tokens. The
extras are timed in alternating order (round r starts at extra r mod n), after one untimed step each; the step
time is rank 0's median. The activation peak of each rank is the glibc heap in use (memory.allocated_bytes)
sampled after every stage forward and backward, minus the heap before the step (gradients are zeroed in place,
so they are part of that baseline), the largest sample of a step, median over the timed steps; printed next to
`openk2 plan`'s activation bytes for the same layout (CPU, fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import machine_summary, run_on_ranks  # noqa: E402

from openk2.config import ModelConfig  # noqa: E402
from openk2.train.config import RunConfig  # noqa: E402
from openk2.train.memory import allocated_bytes  # noqa: E402
from openk2.train.parallel.build import build_model_part  # noqa: E402
from openk2.train.parallel.config import ParallelConfig  # noqa: E402
from openk2.train.parallel.mesh import init_parallel  # noqa: E402
from openk2.train.parallel.pipeline import build_schedule  # noqa: E402
from openk2.train.parallel.plan import plan  # noqa: E402

CPU = torch.device("cpu")
MESH = {"pp": 2, "pp_virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}


def _sampled(stage, method: str, samples: list[int]) -> None:
    """Wrap stage.method to record the heap in use after each call."""
    inner = getattr(stage, method)

    def wrapped(*args, **kwargs):
        out = inner(*args, **kwargs)
        samples.append(allocated_bytes(CPU))
        return out

    setattr(stage, method, wrapped)


def _rank(rank: int, world: int, extras: list[int], m: int, rows: int, seq: int, repeats: int) -> dict:
    config = ModelConfig.preset("tiny")
    tokens = rows * seq
    schedules, samples = {}, {e: [] for e in extras}
    model = None
    for e in extras:  # one model, one schedule (and process groups) per extra
        mesh = init_parallel(ParallelConfig(**MESH, pp_extra_warmup=e), CPU)
        if model is None:
            model, _ = build_model_part(config, mesh, CPU, init_seed=0)
        schedules[e] = build_schedule(model, mesh, (rows, seq), m, _loss(m * tokens), CPU)
        for stage in schedules[e]._stages:
            _sampled(stage, "forward_one_chunk", samples[e])
            _sampled(stage, "backward_one_chunk", samples[e])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (m * rows, seq), generator=gen)

    def step(e: int) -> tuple[float, int]:
        model.zero_grad(set_to_none=False)  # gradients stay allocated: in the baseline, not in the peak
        samples[e].clear()
        before = allocated_bytes(CPU)
        args = (ids,) if model.has_first_stage else ()
        kwargs = {"target": ids, "losses": []} if model.has_last_stage else {}
        start = time.perf_counter()
        schedules[e].step(*args, return_outputs=False, **kwargs)
        seconds = time.perf_counter() - start
        return seconds, max(samples[e]) - before

    for e in extras:
        step(e)  # untimed: the stages allocate their buffers on the first step
    times: dict[int, list[float]] = {e: [] for e in extras}
    peaks: dict[int, list[int]] = {e: [] for e in extras}
    for r in range(repeats):
        for i in range(len(extras)):
            e = extras[(r + i) % len(extras)]
            seconds, peak = step(e)
            times[e].append(seconds)
            peaks[e].append(peak)
    return {e: {"step_s": statistics.median(times[e]), "times": times[e],
                "peak_bytes": int(statistics.median(peaks[e]))} for e in extras}


def _loss(total_tokens: int):
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                               reduction="sum") / total_tokens
    return loss_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extras", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    print(machine_summary())
    result = run_on_ranks(2, _rank, args.extras, args.microbatches, args.rows, args.seq, args.repeats)
    print(f"tiny preset, pp 2 x 2 virtual stages, {args.microbatches} micro-batches of {args.rows} x {args.seq} "
          f"tokens, fp32, gloo, {args.repeats} alternating rounds")
    print(f"{'extra':>5} {'step s (rank 0 median)':>22} {'rank':>4} {'peak MB measured':>16} {'plan MB':>8}")
    rows = []
    for e in args.extras:
        raw = {"model": {"preset": "tiny"}, "data": {"seq_len": args.seq},
               "train": {"batch_size": args.rows, "grad_accum": args.microbatches, "precision": "fp32"},
               "parallel": {**MESH, "pp_extra_warmup": e}}
        planned = plan(RunConfig.from_dict(raw), device_type="cpu")["per_rank"]
        for rank in (0, 1):
            got = result[rank][e]
            print(f"{e:>5} {result[0][e]['step_s']:22.4f} {rank:>4} {got['peak_bytes'] / 1e6:16.1f} "
                  f"{planned[rank]['activation_bytes'] / 1e6:8.1f}")
            rows.append({"extra": e, "rank": rank, **got, "plan_activation_bytes": planned[rank]["activation_bytes"]})
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
