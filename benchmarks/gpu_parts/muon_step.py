"""One Muon step of ours (3-D experts batched) against torch.optim.Muon (every expert its own 2-D matrix) on the
Muon parameters of the K2-shaped config, fp32 parameters with random gradients, on the part's device.

Reuses benchmarks/bench_optim.py's interleaved median timer; the shapes come from the model built on the meta
device and openk2's param_groups, as bench_optim takes them from a preset.
"""

from __future__ import annotations

import torch
from bench_optim import time_steps

from openk2 import K2ForCausalLM
from openk2.optim.muon import Muon
from openk2.optim.ns_kernel import gemm_kind, ns_kernel_timings, select_ns_kernel
from openk2.optim.param_groups import param_groups

from .context import PartContext, PartSkipped
from .sizes import bench_sizes


def muon_shapes(cfg) -> list[tuple[int, ...]]:
    """Shapes of the parameters openk2 gives to Muon (experts stacked [E, out, in])."""
    with torch.device("meta"):
        model = K2ForCausalLM(cfg)
    group = next(g for g in param_groups(model, lr=1.0, weight_decay=0.0) if g["use_muon"])
    return [tuple(p.shape) for p in group["params"]]


def _leaf(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.nn.Parameter:
    """A random parameter with a random gradient, drawn on the device (bench_optim's leaf draws on the CPU,
    which for the K2-shaped config's 1.7B Muon parameters would take longer than the step being timed)."""
    p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device) * 0.02)
    p.grad = torch.randn(shape, generator=gen, device=device)
    return p


def run(ctx: PartContext) -> dict:
    """Median step time of both optimizers, interleaved."""
    if not hasattr(torch.optim, "Muon"):
        raise PartSkipped(f"torch {torch.__version__} has no torch.optim.Muon")
    shapes = muon_shapes(bench_sizes(ctx.quick).model)
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    kw = dict(lr=2e-4, weight_decay=0.1, momentum=0.95, nesterov=True)
    ours = [_leaf(s, gen, ctx.device) for s in shapes]
    matrices = [s[-2:] for s in shapes for _ in range(s[0] if len(s) == 3 else 1)]
    theirs = [_leaf(s, gen, ctx.device) for s in matrices]
    reference = torch.optim.Muon(theirs, adjust_lr_fn="match_rms_adamw", **kw)
    kernel = select_ns_kernel(ctx.device, torch.bfloat16)  # the start-up probe ours runs (optim/ns_kernel.py)
    probe = ns_kernel_timings(ctx.device, torch.bfloat16) or {}
    steps = {"ours": Muon(ours, **kw).step, "torch": reference.step}
    ms = time_steps(steps, warmup=2, repeats=3 if ctx.quick else 5, device=ctx.device)
    params = sum(p.numel() for p in ours)
    return {"status": "measured", "metrics": {
        "tensors_ours": len(shapes), "matrices_torch": len(matrices), "params_m": params / 1e6,
        "ours_ms": ms["ours"], "torch_ms": ms["torch"], "torch_over_ours": ms["torch"] / ms["ours"],
        "ns_kernel": kernel, "bf16_gemm_kind": gemm_kind(ctx.device, torch.bfloat16),
        "ns_probe_ms": ", ".join(f"{k} {v * 1e3:.2f}" for k, v in probe.items()) or "pinned, not measured",
        "settings": "fp32 params and grads, bf16 Newton-Schulz (5 steps) in both, Nesterov, wd 0.1; "
                    "median of interleaved steps after 2 warm-ups",
    }}
