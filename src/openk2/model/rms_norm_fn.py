"""RMSNorm as one autograd node: the forward of `RMSNorm` (fp32 statistics, cast back, then the weight), bit for
bit, with a hand-written backward.

Why: autograd differentiates the norm through ~10 recorded ops (the fp32 cast, pow, mean, rsqrt, the
products, the cast back, the weight), each a pass over [N, D] and a node; in a bf16 training step of the
tiny preset the norms' backward was ~10% of the step (docs/benchmarks.md, "Model forward+backward"). Here the
backward is the closed form, in fp32, from the saved input and 1/rms:

    x^ = x * r,  r = 1 / sqrt(mean(x^2) + eps),  y = cast(x^),  out = w * y
    dL/dw = sum over rows of g * y,   dL/dx = r * (h - x^ * mean(h * x^)),  h = fp32(cast(g * w))

which is the same gradient autograd computes, up to fp32 rounding (tests/model/test_fused_ops.py).
Shape legend: N rows (all leading dims), D normalised width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _normalise(x32: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * r, r) over the last dim: the fused kernel where torch has one (as `F.rms_norm` uses), bit for bit."""
    fused = getattr(torch.ops.aten, "_fused_rms_norm", None)
    if fused is not None and x32.device.type == "cpu":
        out, rstd = fused(x32, [x32.shape[-1]], None, eps)
        return out, rstd
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return F.rms_norm(x32, (x32.shape[-1],), eps=eps), rstd


class RMSNormFunction(torch.autograd.Function):
    """out = weight * cast(rms_norm(fp32(x))), saving x, 1/rms and cast(x^) for the closed-form backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xhat32, rstd = _normalise(x.float(), eps)
        y = xhat32.to(x.dtype)
        ctx.save_for_backward(x, weight, rstd, y)
        return weight * y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd, y = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad_out * y).reshape(-1, y.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            h32 = (grad_out * weight).to(x.dtype).float()
            xhat32 = x.float() * rstd
            dot = (h32 * xhat32).mean(-1, keepdim=True)
            grad_x = h32.sub_(xhat32.mul_(dot)).mul_(rstd).to(x.dtype)
        return grad_x, grad_w, None
