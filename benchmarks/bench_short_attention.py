"""Causal attention at a few hundred keys on CPU: SDPA's flash kernel (v padded to the q/k head dim) against
`short_attention` (materialised fp32 probabilities, v unpadded) and SDPA with unequal dims (its math kernel).

Inputs are MLA-shaped (the preset's heads, q/k head dim N+R, v head dim V); time is process CPU time per
forward + backward (robust to other processes' load with 1 thread), median over `--repeats` calls per kernel,
the kernels interleaved. The largest output and gradient difference from an fp64 explicit softmax is printed
beside each.

Usage: python benchmarks/bench_short_attention.py --preset tiny --lengths 128 256 512 1024 --repeats 15
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
from openk2.model.attention_core import fused_attend  # noqa: E402
from openk2.model.short_attention import short_attention  # noqa: E402

KERNELS = {
    "flash (v padded)": fused_attend,
    "short": lambda q, k, v, scale: short_attention(q, k, v, scale)[0],
    "sdpa math (unequal dims)": lambda q, k, v, scale: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                      scale=scale),
}


def worst_error(kernel, q, k, v, scale, grad_out) -> float:
    """Largest |difference| / max |reference| over output and the three input gradients, against fp64."""
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = kernel(*inputs, scale)
    got = [out, *torch.autograd.grad(out, inputs, grad_out)]
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, scale=scale)
    want = [ref, *torch.autograd.grad(ref, ref_in, grad_out.double())]
    return max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want, strict=True))


def time_kernels(q, k, v, scale: float, grad_out, repeats: int) -> dict[str, list[float]]:
    """CPU seconds per forward + backward of each kernel on these inputs, interleaved, after one warm-up round."""
    return alternating_cpu_times(
        list(KERNELS), lambda n, _i: lambda: torch.autograd.grad(KERNELS[n](q, k, v, scale), (q, k, v), grad_out),
        repeats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-tokens", type=int, default=2048, help="batch = this // length sequences")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_summary()}")
    cfg = ModelConfig.preset(args.preset)
    h, qk, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    scale = qk ** -0.5
    print(f"preset {args.preset}: {h} heads, q/k head dim {qk}, v head dim {vd}; causal; "
          f"{args.batch_tokens} tokens per call")
    print("| dtype | T | batch | " + " | ".join(KERNELS) + " | flash / short |")
    print("|---|---:|---:|" + "---:|" * (len(KERNELS) + 1))
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for t in args.lengths:
            b = max(1, args.batch_tokens // t)
            g = torch.Generator().manual_seed(t)
            q, k = (torch.randn(b, h, t, qk, generator=g).to(dtype).requires_grad_() for _ in range(2))
            v = torch.randn(b, h, t, vd, generator=g).to(dtype).requires_grad_()
            grad_out = torch.randn(b, h, t, vd, generator=g).to(dtype)
            errors = {n: worst_error(fn, q, k, v, scale, grad_out) for n, fn in KERNELS.items()}
            times = time_kernels(q, k, v, scale, grad_out, args.repeats)
            med = {n: statistics.median(x) * 1e3 for n, x in times.items()}
            cells = " | ".join(f"{med[n]:.1f} ms (err {errors[n]:.0e})" for n in KERNELS)
            print(f"| {name} | {t} | {b} | {cells} | {med['flash (v padded)'] / med['short']:.2f}x |", flush=True)
    print(f"machine after: {machine_summary()}")


if __name__ == "__main__":
    main()
