"""bf16 weights with fp32 gradient accumulation and fp32 masters (K2 report, section 2.4: "bf16 parameters and
fp32 gradient accumulation"), the pieces DistributedMuonClip uses when `parallel.param_dtype = "bfloat16"`.

* Gradients: a post-accumulate-grad hook adds each bf16 `.grad` into an fp32 `main_grad` on the parameter and
  frees the bf16 one, so micro-batches (and pipeline stages' backward pieces) sum in fp32; `grad_of` is what
  the gradient reduction reads.
* QK-Clip on masters: `clip_factors` runs the real QK-Clip (optim/qk_clip.py) on stand-in layers whose
  weights are fp32 ones, which yields each query/key weight's per-element factor exactly; the optimizer then
  multiplies its fp32 masters by it before the rounded weights go out, as the fp32 path multiplies the
  weights (the clip would otherwise be lost: the next update starts from the unclipped master).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from openk2.optim.qk_clip import QKClip

PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QK_PROJECTIONS = ("q_proj", "q_b_proj", "kv_b_proj", "k_proj")  # the weights QK-Clip rescales


def grad_of(p: nn.Parameter) -> torch.Tensor | None:
    """The gradient the optimizer reduces: the fp32 `main_grad` under bf16 weights, else `.grad`.

    A `.grad` still present under bf16 weights was written outside autograd's accumulation, where the hook does
    not fire: torch's zero-bubble schedules add each micro-batch's weight gradient by hand (`grad += dw`). It is
    folded in here (summed over those micro-batches in bf16, then in fp32) instead of being left out."""
    if not hasattr(p, "main_grad"):
        return p.grad
    if p.grad is not None:
        _accumulate(p)
    return p.main_grad


def _accumulate(p: nn.Parameter) -> None:
    grad = p.grad.float()
    p.main_grad = grad if p.main_grad is None else p.main_grad.add_(grad)
    p.grad = None


def accumulate_in_fp32(params: list[nn.Parameter]) -> None:
    """Route every backward's gradient of `params` into an fp32 `p.main_grad` (None until the first one)."""
    for p in params:
        p.main_grad = None
        p.register_post_accumulate_grad_hook(_accumulate)


def clear_fp32_grads(params: list[nn.Parameter]) -> None:
    """Drop the accumulated fp32 gradients."""
    for p in params:
        if hasattr(p, "main_grad"):
            p.main_grad = None


def qk_stand_in(layer: nn.Module, shape_of: Callable[[torch.Tensor], tuple[int, ...]] | None = None) -> nn.Module:
    """A shallow copy of an attention layer whose query/key projections hold fp32 ones, each of its parameter's
    shape or `shape_of(parameter)` (FSDP2: [rows, 1]): QKClip's rescaling applied to it leaves the factors."""
    probe = copy.copy(layer)
    probe.__dict__["_modules"] = dict(layer._modules)
    for name in QK_PROJECTIONS:
        proj = layer._modules.get(name)
        if proj is None:
            continue
        fake = copy.copy(proj)
        fake.__dict__["_parameters"] = {k: None if v is None else
                                        torch.ones(v.shape if shape_of is None else shape_of(v), device=v.device)
                                        for k, v in proj._parameters.items()}
        probe.__dict__["_modules"][name] = fake
    return probe


@torch.no_grad()
def clip_factors(layers: dict[int, nn.Module], max_logits: torch.Tensor, tau: float) -> dict[int, torch.Tensor]:
    """id(parameter) -> fp32 factor of its shape, for the query/key weights QK-Clip rescales from the step's
    (already reduced) max logits [L, H]; only layers with a clipped head. `layers`: global index -> attention."""
    out: dict[int, torch.Tensor] = {}
    for index, layer in layers.items():
        if not (max_logits[index] > tau).any():
            continue
        probe = qk_stand_in(layer)
        QKClip(attention_layers=[probe], tau=tau).apply(max_logits[index][None].float(), reduce=False)
        for name in QK_PROJECTIONS:
            real, fake = layer._modules.get(name), probe._modules.get(name)
            if real is None:
                continue
            for key, p in real._parameters.items():
                if p is not None:
                    out[id(p)] = fake._parameters[key]
    return out
