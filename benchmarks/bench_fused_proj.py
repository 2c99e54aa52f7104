"""Two projections of one input as one GEMM: q_a_proj + kv_a_proj_with_mqa (MLA), gate + up (dense MLP, shared
expert), at the preset's shapes, bf16, forward + backward (issue 25).

"separate" is two `F.linear` calls (the model's code); "fused" concatenates the two weights per call (they stay
separate parameters, so checkpoint names are unchanged) and splits the output. Time is process CPU time per
call, median of `--repeats`, the two interleaved. Rows = batch x sequence tokens.

Usage: python benchmarks/bench_fused_proj.py --preset tiny --repeats 21
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DTYPES, alternating_cpu_times, machine_summary  # noqa: E402

from openk2 import ModelConfig  # noqa: E402


def pairs(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """name -> (input width, first output width, second output width)."""
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    return {"q_a + kv_a": (cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
            "dense gate + up": (cfg.hidden_size, cfg.intermediate_size, cfg.intermediate_size),
            "shared gate + up": (cfg.hidden_size, shared, shared)}


def separate(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, grads: list[torch.Tensor]):
    """Two linears of x, forward + backward (the model's code)."""
    return torch.autograd.grad([F.linear(x, w1), F.linear(x, w2)], (x, w1, w2), grads)


def fused(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, grads: list[torch.Tensor]):
    """One linear of x over the two weights concatenated, its output split, forward + backward."""
    outs = F.linear(x, torch.cat((w1, w2))).split([w1.shape[0], w2.shape[0]], dim=-1)
    return torch.autograd.grad(list(outs), (x, w1, w2), grads)


VARIANTS = {"separate": separate, "fused": fused}


def time_variants(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, grads: list[torch.Tensor],
                  repeats: int) -> dict[str, list[float]]:
    """CPU seconds per call of each variant on these inputs, interleaved, after two warm-up rounds."""
    return alternating_cpu_times(list(VARIANTS), lambda k, _i: lambda: VARIANTS[k](x, w1, w2, grads), repeats,
                                 warmup=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_summary()}")
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    for name, (d, o1, o2) in pairs(ModelConfig.preset(args.preset)).items():
        x = torch.randn(args.rows, d, generator=g).to(dtype).requires_grad_()
        w1, w2 = (torch.randn(o, d, generator=g).to(dtype).requires_grad_() for o in (o1, o2))
        grads = [torch.randn(args.rows, o, generator=g).to(dtype) for o in (o1, o2)]

        times = time_variants(x, w1, w2, grads, args.repeats)
        sep, fus = (statistics.median(times[k]) * 1e3 for k in VARIANTS)
        print(f"{args.preset} {name:<17} [{args.rows} x {d}] -> {o1} + {o2}: separate {sep:6.2f} ms, "
              f"fused {fus:6.2f} ms, separate/fused {sep / fus:.2f}x", flush=True)
    print(f"machine after: {machine_summary()}")


if __name__ == "__main__":
    main()
