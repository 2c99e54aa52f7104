"""Small building blocks shared by attention and MoE: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openk2.model.rms_norm_fn import RMSNormFunction


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (as DeepSeek-V3), weight applied after casting back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) on the fp32 copy in one fused kernel, bit for bit the pow/mean/rsqrt/mul it
        # replaces (tests/model/test_fused_ops.py); with gradients, one autograd node with a closed-form backward.
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return RMSNormFunction.apply(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
