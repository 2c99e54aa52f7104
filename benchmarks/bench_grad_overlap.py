"""DP gradient reduction overlapped with backward: dp2 step time and exposed communication, overlap on vs off.

Usage: python benchmarks/bench_grad_overlap.py [--preset small] [--layers 4] [--experts 16] [--batch 4]
       [--seq 128] [--accum 2] [--bucket-numel 4194304] [--repeats 10]

Model: `K2ForCausalLM(ModelConfig.preset(PRESET))` cut to `--layers` decoder layers (1 dense + MoE) and
`--experts` routed experts, fp32, replicated on 2 gloo ranks (one torch thread each); ZeRO-1
`DistributedMuonClip` (Muon + AdamW + QK-Clip, bf16 Newton-Schulz) built with overlap_grad_reduce=True and
`--bucket-numel` elements per gradient bucket. A step is what ParallelTrainer does: `--accum` micro-batches of
`--batch` x `--seq` random tokens per rank (forward + backward), gradient reduction, norm, update. Overlap on:
the buckets are armed before the last backward, as the trainer does; off: they are not armed, so every bucket
is issued after backward, exactly as with overlap_grad_reduce=false (the same buckets and collectives; only
the process group object differs, with the same ranks). On and off alternate on the same model, which goes
first swapping each repeat; medians over `--repeats` after one warm-up of each, and the median of the
per-round off/on ratios (a round's two steps ran next to each other, so a load swing hits both). Step: wall time between
barriers, the slower rank's. Exposed communication (train/parallel/comm_clock.py): `grad` is the gradient
reduction's share on the critical path (packing and issuing from the hooks during backward, plus the drain:
issuing what is left and waiting); `all` adds the update broadcasts, the all-gather, the norm and max-logit
all-reduces; the mean over ranks.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import machine_summary, run_on_ranks  # noqa: E402

from openk2.config import ModelConfig  # noqa: E402


def _step(model, opt, batches: list[torch.Tensor], overlap: bool) -> tuple[float, float, float]:
    """(step seconds of the slower rank, this rank's exposed gradient-reduction seconds, all comm seconds)."""
    from openk2.model import ForwardStats
    from openk2.train.parallel import comm_clock

    dist.barrier()
    comm_clock.take()
    start = time.perf_counter()
    stats = ForwardStats(model.config, track_max_logits=True)
    for i, ids in enumerate(batches):
        loss = model(ids, labels=ids, stats=stats).loss / len(batches)
        if overlap and i == len(batches) - 1:
            opt.arm_overlap(1)
        loss.backward()
    opt.reduce_gradients()
    grad = comm_clock.take()
    opt.clip_grad_norm(1.0)
    opt.step(stats.max_logits())
    opt.zero_grad()
    step = torch.tensor([time.perf_counter() - start])
    rest = comm_clock.take()
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    return float(step), grad, grad + rest


def _ranks(rank: int, world: int, args: dict) -> dict:
    from openk2.model import K2ForCausalLM
    from openk2.optim.ns_kernel import pin_ns_kernel
    from openk2.train.parallel.zero import DistributedMuonClip

    cfg = dataclasses.replace(ModelConfig.preset(args["preset"]), num_hidden_layers=args["layers"],
                              n_routed_experts=args["experts"])
    model = K2ForCausalLM(cfg, init_seed=0).train()
    pin_ns_kernel(torch.device("cpu"), torch.bfloat16, "emulated")  # the same kernel on both ranks, untimed
    opt = DistributedMuonClip(model, list(model.named_parameters()), dict(enumerate(model.attention_layers())),
                              lr=1e-3, tau=100.0, overlap_grad_reduce=True, grad_bucket_numel=args["bucket_numel"])
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, cfg.vocab_size, (args["batch"], args["seq"]), generator=gen)
               for _ in range(args["accum"])]
    times: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    hooked: dict[bool, list[int]] = {True: [], False: []}
    for i in range(args["repeats"] + 1):
        for overlap in ((True, False) if i % 2 == 0 else (False, True)):
            result = _step(model, opt, batches, overlap)
            if i:  # the first round is a warm-up
                times[overlap].append(result)
                hooked[overlap].append(opt.overlap_stats().last[0])
    medians = torch.tensor([[statistics.median(t[j] for t in times[o]) for j in (1, 2)] for o in (True, False)])
    gathered = [torch.zeros_like(medians) for _ in range(world)]
    dist.all_gather(gathered, medians)
    mean = torch.stack(gathered).mean(0)
    buckets = len(opt.reducers["dense"].buckets)
    return {str(o).lower(): {"step_s": [t[0] for t in times[o]], "step_s_median": statistics.median(
        t[0] for t in times[o]), "exposed_grad_comm_s_median": float(mean[j, 0]),
        "exposed_comm_s_median": float(mean[j, 1]), "buckets_from_hooks": hooked[o][-1], "buckets": buckets}
        for j, o in enumerate((True, False))} | {"params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers kept (the first is dense)")
    parser.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer")
    parser.add_argument("--batch", type=int, default=4, help="rows per rank per micro-batch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--bucket-numel", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if min(args.batch, args.seq, args.accum, args.bucket_numel, args.repeats) < 1 or args.layers < 2:
        raise ValueError("--layers must be >= 2 and --batch, --seq, --accum, --bucket-numel, --repeats >= 1")
    out = run_on_ranks(2, _ranks, vars(args))[0]
    on, off = out["true"], out["false"]
    print(machine_summary())
    print(f"dp2 ZeRO-1 step, preset {args.preset} with {args.layers} layers and {args.experts} experts "
          f"({out['params'] / 1e6:.1f} M parameters, {on['buckets']} buckets of <= {args.bucket_numel} elements), "
          f"{args.accum} x {args.batch}x{args.seq} tokens per rank, median of {args.repeats} alternating runs")
    print(f"{'overlap':>8} {'step s':>8} {'exposed grad-reduce s':>22} {'exposed comm s':>15} "
          f"{'buckets from hooks':>19}")
    for name, row in (("on", on), ("off", off)):
        print(f"{name:>8} {row['step_s_median']:8.3f} {row['exposed_grad_comm_s_median']:22.3f} "
              f"{row['exposed_comm_s_median']:15.3f} {row['buckets_from_hooks']:>19}")
    paired = statistics.median(f / n for f, n in zip(off["step_s"], on["step_s"], strict=True))
    print(f"off/on step time: {off['step_s_median'] / on['step_s_median']:.3f} (medians), {paired:.3f} (median of "
          f"the rounds' ratios); load now {os.getloadavg()[0]:.1f}")
    print(json.dumps({"args": vars(args), **out}))


if __name__ == "__main__":
    main()
