"""Distributed Muon vs single-process Muon on the same matrices, and optimizer-state bytes per rank vs `openk2 plan`.

Usage: python benchmarks/bench_dist_muon.py [--preset tiny] [--worlds 2 4] [--repeats 3] [--state-preset small]

Step: the Muon parameters `default_muon_filter` picks from `K2ForCausalLM(ModelConfig.preset(PRESET))`, fixed
random gradients. World 1 is `openk2.optim.muon.Muon.step()`; world N (gloo, one thread per process) is
`DistributedMuon.reduce_gradients()` + `step()` over all N ranks (owners balanced by Newton-Schulz FLOPs),
timed between barriers, so a step is the slowest rank's. FLOPs per rank: Newton-Schulz multiply-adds of the
matrices a rank orthogonalises. State: `DistributedMuonClip.state_bytes()` (the tensors it holds) per rank at
dp = 1, 2, 4 on `--state-preset`, next to `openk2 plan`'s optimizer + master bytes for the same layout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from common import run_on_ranks  # noqa: E402

from openk2.config import ModelConfig  # noqa: E402
from openk2.model import K2ForCausalLM  # noqa: E402
from openk2.optim.param_groups import default_muon_filter  # noqa: E402

HYPER = {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "rms_scale": 0.2, "ns_dtype": torch.bfloat16}


def _muon_params(preset: str) -> list[torch.nn.Parameter]:
    model = K2ForCausalLM(ModelConfig.preset(preset), init_seed=0)
    return [p for name, p in model.named_parameters() if default_muon_filter(name, p)]


def _set_grads(params: list[torch.nn.Parameter], share: float) -> None:
    gen = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * (1e-3 * share)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _single_step(preset: str, repeats: int) -> dict:
    from openk2.optim.muon import Muon
    from openk2.train.parallel.owners import newton_schulz_flops

    params = _muon_params(preset)
    opt = Muon(params, lr=1e-3, weight_decay=0.1, **HYPER)
    times = []
    for i in range(repeats + 1):
        _set_grads(params, 1.0)
        start = time.perf_counter()
        opt.step()
        if i:  # the first step is a warm-up
            times.append(time.perf_counter() - start)
    flops = sum(newton_schulz_flops(tuple(p.shape), HYPER["ns_steps"]) for p in params)
    return {"step_s": statistics.median(times), "flops_per_rank": [flops], "matrices": len(params)}


def _dist_step(rank: int, world: int, preset: str, repeats: int) -> dict:
    from openk2.train.parallel.dist_muon import DistributedMuon

    params = _muon_params(preset)
    opt = DistributedMuon(params, None, **HYPER)
    times = []
    for i in range(repeats + 1):
        _set_grads(params, 1.0 / world)
        _barrier()
        start = time.perf_counter()
        opt.reduce_gradients()
        opt.step(lr=1e-3, weight_decay=0.1)
        _barrier()
        if i:
            times.append(time.perf_counter() - start)
    flops = torch.tensor([float(sum(u.flops for u in opt.owned))])
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, flops)
    return {"step_s": statistics.median(times), "flops_per_rank": [int(t) for t in gathered]}


def _state_bytes(rank: int, world: int, preset: str) -> int:
    from openk2.train.parallel.zero import DistributedMuonClip

    model = K2ForCausalLM(ModelConfig.preset(preset), init_seed=0)
    opt = DistributedMuonClip(model, list(model.named_parameters()), dict(enumerate(model.attention_layers())),
                              lr=1e-3, **HYPER)
    measured = torch.tensor([float(opt.state_bytes())], dtype=torch.float64)
    if not dist.is_initialized():
        return int(measured)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    return int(measured)


def _planned_bytes(preset: str, dp: int) -> int:
    from openk2.train.config import RunConfig
    from openk2.train.parallel.plan import plan

    cfg = RunConfig.from_dict({"model": {"preset": preset}, "parallel": {"dp": dp}})
    return max(r["optimizer_bytes"] + r["master_bytes"] for r in plan(cfg, states="fp32")["per_rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="model whose Muon matrices are stepped")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--state-preset", default="small", help="model whose optimizer state is counted")
    parser.add_argument("--state-dps", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = {1: _single_step(args.preset, args.repeats)}
    for world in args.worlds:
        steps[world] = run_on_ranks(world, _dist_step, args.preset, args.repeats)[0]
    states = {}
    for dp in args.state_dps:
        measured = (_state_bytes(0, 1, args.state_preset) if dp == 1
                    else run_on_ranks(dp, _state_bytes, args.state_preset)[0])
        states[dp] = {"measured": measured, "planned": _planned_bytes(args.state_preset, dp)}
    print(f"Muon step, preset {args.preset} ({steps[1]['matrices']} Muon tensors), median of {args.repeats}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    print(f"{'world':>5} {'step s':>8} {'speed-up':>8} {'NS GFLOP/rank (max)':>20} {'of world 1':>10}")
    base_s, base_f = steps[1]["step_s"], steps[1]["flops_per_rank"][0]
    for world, row in steps.items():
        worst = max(row["flops_per_rank"])
        print(f"{world:>5} {row['step_s']:8.3f} {base_s / row['step_s']:8.2f} {worst / 1e9:20.2f} "
              f"{worst / base_f:10.3f}")
    print(f"optimizer state per rank (max over ranks), preset {args.state_preset}")
    print(f"{'dp':>3} {'measured MB':>12} {'plan MB':>10} {'plan/measured':>14}")
    for dp, row in states.items():
        print(f"{dp:>3} {row['measured'] / 1e6:12.2f} {row['planned'] / 1e6:10.2f} "
              f"{row['planned'] / row['measured']:14.4f}")
    print(json.dumps({"steps": {str(k): v for k, v in steps.items()},
                      "states": {str(k): v for k, v in states.items()}}))


if __name__ == "__main__":
    main()
