"""The correctness parts: each runs one function of gpu_parts.correctness on the part's device."""

from __future__ import annotations

from .context import PartContext
from .correctness import CHECKS


def _run(name: str, ctx: PartContext) -> dict:
    return {"status": "passed", "metrics": CHECKS[name](ctx.device)}


def hf_logits(ctx: PartContext) -> dict:
    """Logits and loss vs transformers' DeepseekV3, fp32 and bf16."""
    return _run("hf_logits", ctx)


def muon_vs_torch(ctx: PartContext) -> dict:
    """Muon vs torch.optim.Muon on 2-D matrices and on experts split to 2-D."""
    return _run("muon_vs_torch", ctx)


def qk_clip(ctx: PartContext) -> dict:
    """QK-Clip scales clipped heads' logits by exactly gamma and touches nothing else."""
    return _run("qk_clip", ctx)


def fp8_activations(ctx: PartContext) -> dict:
    """FP8 tiles within e4m3's bound; a step with FP8 saves within FP8 noise of the exact one."""
    return _run("fp8_activations", ctx)


def offload(ctx: PartContext) -> dict:
    """CPU offload of saved activations gives the exact step."""
    return _run("offload", ctx)


def engine_decode(ctx: PartContext) -> dict:
    """The engine's cached decode gives the full forward's logits."""
    return _run("engine_decode", ctx)
