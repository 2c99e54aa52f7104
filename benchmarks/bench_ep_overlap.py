"""EP overlap: ep2 forward+backward step time with `parallel.ep_overlap` on vs off, and the exposed all-to-all time.

Usage: python benchmarks/bench_ep_overlap.py [--preset small] [--layers 4] [--batch 4] [--seq 128] [--repeats 10]

Model: `K2ForCausalLM(ModelConfig.preset(PRESET))` cut to `--layers` decoder layers (1 dense + MoE), fp32, its
routed experts split over 2 gloo ranks (one torch thread each) as `shard_experts` does; each rank its own
`--batch` x `--seq` random tokens. A step is forward + backward of the token-mean cross-entropy (no optimizer),
timed between barriers, so it is the slower rank's. On and off run on the same weights (the flag is flipped on
the same modules), alternating which goes first in each repeat; medians over `--repeats` after one warm-up
each, and the median over rounds of off - on (the two runs of a round see about the same load). Exposed
all-to-all: `comm_clock` seconds of the step on this rank (the EP count exchange, and the issue and wait of
every dispatch/combine and their backward reverses; what runs between issue and wait is not in it), the mean
over ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import machine_summary, run_on_ranks  # noqa: E402

from openk2.config import ModelConfig  # noqa: E402


def _model(preset: str, layers: int, rank: int, world: int):
    from openk2.model import K2ForCausalLM
    from openk2.model.moe import MoE
    from openk2.train.parallel.expert import ExpertParallelExperts

    cfg = dataclasses.replace(ModelConfig.preset(preset), num_hidden_layers=layers)
    model = K2ForCausalLM(cfg, init_seed=0)
    experts = []
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp.experts = ExpertParallelExperts(layer.mlp.experts, dist.group.WORLD, rank, world)
            experts.append(layer.mlp.experts)
    return model.train(), cfg, experts


def _step(model, ids: torch.Tensor) -> tuple[float, float]:
    """(step seconds of the slower rank, this rank's comm_clock seconds) of one forward + backward."""
    from openk2.train.parallel import comm_clock

    model.zero_grad(set_to_none=True)
    dist.barrier()
    comm_clock.take()
    start = time.perf_counter()
    logits = model(ids[:, :-1]).logits
    F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
    step = torch.tensor([time.perf_counter() - start])
    comm = comm_clock.take()
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    return float(step), comm


def _ranks(rank: int, world: int, preset: str, layers: int, batch: int, seq: int, repeats: int) -> dict:
    model, cfg, experts = _model(preset, layers, rank, world)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(rank))
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(repeats + 1):
        for overlap in ((True, False) if i % 2 == 0 else (False, True)):
            for module in experts:
                module.overlap = overlap
            result = _step(model, ids)
            if i:  # the first round is a warm-up
                times[overlap].append(result)
    comm = torch.tensor([[statistics.median(c for _, c in times[o]) for o in (True, False)]])
    gathered = [torch.zeros_like(comm) for _ in range(world)]
    dist.all_gather(gathered, comm)
    return {str(o).lower(): {"step_s": [s for s, _ in times[o]], "step_s_median": statistics.median(
        s for s, _ in times[o]), "exposed_comm_s_median": float(torch.cat(gathered)[:, j].mean())}
        for j, o in enumerate((True, False))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers kept (the first is dense)")
    parser.add_argument("--batch", type=int, default=4, help="rows per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.layers < 2 or args.batch < 1 or args.seq < 1 or args.repeats < 1:
        raise ValueError("--layers must be >= 2 and --batch, --seq, --repeats >= 1")
    out = run_on_ranks(2, _ranks, args.preset, args.layers, args.batch, args.seq, args.repeats)[0]
    on, off = out["true"], out["false"]
    print(machine_summary())
    print(f"ep2 forward+backward, preset {args.preset} with {args.layers} layers, {args.batch}x{args.seq} tokens "
          f"per rank, median of {args.repeats} alternating runs")
    print(f"{'ep_overlap':>10} {'step s':>8} {'exposed a2a s':>14}")
    for name, row in (("on", on), ("off", off)):
        print(f"{name:>10} {row['step_s_median']:8.4f} {row['exposed_comm_s_median']:14.4f}")
    paired = [b - a for a, b in zip(on["step_s"], off["step_s"], strict=True)]  # one round: about one load
    print(f"off/on step time: {off['step_s_median'] / on['step_s_median']:.3f}; per round off - on: median "
          f"{statistics.median(paired):+.4f} s, on faster in {sum(d > 0 for d in paired)}/{len(paired)}; load now "
          f"{os.getloadavg()[0]:.1f}")
    print(json.dumps({"args": vars(args), **out}))


if __name__ == "__main__":
    main()
