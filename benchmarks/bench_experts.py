"""Routed experts, forward + backward of one MoE layer: ways to run the per-expert matmuls on CPU (issue 25).

Rows and routings come from a real model of the preset (its first MoE layer on random batches, bf16 weights), so
the per-expert row counts have the imbalance of an untrained router. Each timed call takes the next of
`--routings` captured routings, as a training step would (1 = the same routing every call, which lets oneDNN
reuse every per-shape kernel it built). Variants, all the same products on every real row:

- loop: HEAD's path: dispatch (index_select), three `grouped_linear` (on CPU `grouped_mm` loops over experts
  with each expert's own row count), weights, combine (index_add);
- loop+gate_up: the same with gate and up as one grouped matmul over the concatenated weights [E, 2I, D];
- aligned-A: each expert's rows padded with zero rows to a multiple of A (`moe.aligned_rows`), then as loop;
- bmm-A: every expert padded to the largest count (rounded up to A): one `torch.bmm` per projection over
  [E, capacity, D];
- model: `RoutedExperts.forward` as it is in the tree.

Time is process CPU time per call (robust to other processes' load with 1 thread), median over `--repeats`
calls per variant, the variants interleaved (order reversed every other round).

Usage: python benchmarks/bench_experts.py --preset tiny --repeats 15 --routings 12 --threads 1
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

from openk2 import K2ForCausalLM, ModelConfig  # noqa: E402
from openk2.model.moe import RoutedExperts, Routing, aligned_rows, grouped_linear  # noqa: E402


def capture_routings(preset: str, batches: int, dtype: torch.dtype, seed: int, batch_size: int, seq_len: int):
    """The first MoE layer's experts module and (x [N, D], routing) of `batches` random batches."""
    cfg = ModelConfig.preset(preset)
    torch.manual_seed(seed)
    model = K2ForCausalLM(cfg).train().to(dtype)
    experts = model.moe_layers()[0].experts
    seen: list[tuple[torch.Tensor, Routing]] = []
    handle = experts.register_forward_pre_hook(lambda _m, args: seen.append((args[0].detach(), args[1])))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randint(0, cfg.vocab_size, (batch_size, seq_len), generator=gen))
    handle.remove()
    return experts, seen


def _sorted(routing: Routing, num_experts: int):
    k = routing.indices_NK.shape[1]
    flat = routing.indices_NK.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // k, counts, flat[order]


def _combine(y_MD, weights_M, rows_M, n):
    y_MD = y_MD * weights_M[:, None].to(y_MD.dtype)
    return torch.zeros(n + 1, y_MD.shape[-1], dtype=y_MD.dtype).index_add_(0, rows_M, y_MD)[:n]


def _swiglu(ex: RoutedExperts, x_MD, offsets, gate_up: bool):
    if gate_up:
        gate, up = grouped_linear(x_MD, torch.cat((ex.gate_proj, ex.up_proj), 1), offsets, True).chunk(2, -1)
    else:
        gate = grouped_linear(x_MD, ex.gate_proj, offsets, True)
        up = grouped_linear(x_MD, ex.up_proj, offsets, True)
    return grouped_linear(F.silu(gate) * up, ex.down_proj, offsets, True)


def loop(ex: RoutedExperts, x_ND, routing: Routing, gate_up: bool = False):
    """HEAD's dispatch: rows sorted by expert, each expert's own row count."""
    order, tokens, counts, _ = _sorted(routing, ex.gate_proj.shape[0])
    y = _swiglu(ex, x_ND.index_select(0, tokens), counts.cumsum(0).to(torch.int32), gate_up)
    return _combine(y, routing.weights_NK.reshape(-1)[order], tokens, x_ND.shape[0])


def aligned(ex: RoutedExperts, x_ND, routing: Routing, align: int, gate_up: bool = False):
    """Each expert's rows padded to a multiple of `align` with zero rows (read from an appended zero row)."""
    n, d = x_ND.shape
    order, tokens, counts, experts_M = _sorted(routing, ex.gate_proj.shape[0])
    rows_P, dest_M, offsets = aligned_rows(experts_M, tokens, counts, n, align)
    x_PD = torch.cat((x_ND, x_ND.new_zeros(1, d))).index_select(0, rows_P)
    weights_M = routing.weights_NK.reshape(-1)[order]
    weights_P = weights_M.new_zeros(rows_P.shape[0]).scatter(0, dest_M, weights_M)
    return _combine(_swiglu(ex, x_PD, offsets, gate_up), weights_P, rows_P, n)


def bmm(ex: RoutedExperts, x_ND, routing: Routing, align: int):
    """Every expert padded to the largest row count (rounded up to `align`): one batched matmul per projection."""
    n, d = x_ND.shape
    e = ex.gate_proj.shape[0]
    order, tokens, counts, experts_M = _sorted(routing, e)
    cap = int(-(-int(counts.max()) // align) * align)
    dest_M = experts_M * cap + torch.arange(order.numel()) - (counts.cumsum(0) - counts)[experts_M]
    rows_P = torch.full((e * cap,), n, dtype=torch.long).index_copy_(0, dest_M, tokens)
    x_ECD = torch.cat((x_ND, x_ND.new_zeros(1, d))).index_select(0, rows_P).view(e, cap, d)
    h = F.silu(x_ECD @ ex.gate_proj.transpose(1, 2)) * (x_ECD @ ex.up_proj.transpose(1, 2))
    y_PD = (h @ ex.down_proj.transpose(1, 2)).view(e * cap, d)
    weights_M = routing.weights_NK.reshape(-1)[order]
    return _combine(y_PD, weights_M.new_zeros(e * cap).scatter(0, dest_M, weights_M), rows_P, n)


def variants(aligns: list[int]) -> dict:
    table = {"loop": loop, "loop+gate_up": lambda ex, x, r: loop(ex, x, r, gate_up=True)}
    for a in aligns:
        table[f"aligned-{a}"] = lambda ex, x, r, a=a: aligned(ex, x, r, a)
        table[f"aligned-{a}+gate_up"] = lambda ex, x, r, a=a: aligned(ex, x, r, a, gate_up=True)
    table[f"bmm-{aligns[0]}"] = lambda ex, x, r: bmm(ex, x, r, aligns[0])
    table["model"] = lambda ex, x, r: ex(x, r)[0]
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--routings", type=int, default=12, help="distinct routings cycled through (1 = fixed)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--aligns", default="16,32,64")
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_summary()}")
    dtype = DTYPES[args.dtype]
    ex, seen = capture_routings(args.preset, args.routings, dtype, args.seed, args.batch_size, args.seq_len)
    counts = torch.stack([torch.bincount(r.indices_NK.reshape(-1), minlength=ex.gate_proj.shape[0]) for _, r in seen])
    print(f"preset {args.preset}, {args.dtype}: {seen[0][0].shape[0]} tokens x top-{seen[0][1].indices_NK.shape[1]}"
          f" over {ex.gate_proj.shape[0]} experts (D {ex.gate_proj.shape[2]}, I {ex.gate_proj.shape[1]}); rows per "
          f"expert over {len(seen)} routings: min {int(counts.min())}, median {int(counts.median())}, "
          f"max {int(counts.max())}")
    table = variants([int(a) for a in args.aligns.split(",")])
    if args.only:
        table = {k: v for k, v in table.items() if k in args.only.split(",")}

    # Exactness against HEAD's path on the first routing: output, input gradient, expert weight gradients.
    x0, r0 = seen[0]
    grad_out = torch.randn(x0.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    reference = None
    for name, fn in {"loop": loop, **table}.items():
        x = x0.clone().requires_grad_(True)
        ex.zero_grad(set_to_none=True)
        out = fn(ex, x, r0)
        out.backward(grad_out)
        got = [out.float(), x.grad.float()] + [p.grad.float() for p in ex.parameters()]
        if reference is None:
            reference = got
            continue
        worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, reference, strict=True))
        print(f"  {name:<20} largest difference from loop (output, dx, expert grads; relative to max): {worst:.1e}")

    def prepare(name: str, i: int):  # round i takes the next captured routing (round 0 warms up)
        x_i, r_i = seen[i % len(seen)]
        x = x_i.clone().requires_grad_(True)
        ex.zero_grad(set_to_none=True)
        return lambda: table[name](ex, x, r_i).backward(grad_out)

    times = alternating_cpu_times(list(table), prepare, args.repeats)
    base = statistics.median(times["loop"]) if "loop" in times else None
    print(f"\nforward+backward of one MoE layer's routed experts, CPU ms per call (median of {args.repeats}, "
          f"{len(seen)} routings cycled):")
    for name, t in times.items():
        rel = f"  loop/this {base / statistics.median(t):.2f}x" if base else ""
        print(f"  {name:<20} {statistics.median(t) * 1e3:7.1f} ms  (range {min(t) * 1e3:.1f}-{max(t) * 1e3:.1f}){rel}")
    print(f"machine after: {machine_summary()}")


if __name__ == "__main__":
    main()
