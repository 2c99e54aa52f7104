"""Rotary position embedding with DeepSeek-V3's YaRN scaling (correction range, linear ramp, mscale).

Shape legend: B batch, T sequence, H heads, R rotary dim (qk_rope_head_dim).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from openk2.config import ModelConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor 0.1*mscale*ln(scale) + 1 (1 when not extending)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    # The rotary pair index whose wavelength completes `num_rotations` turns over `max_pos` positions.
    return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [R/2] and the cos/sin amplitude factor, as DeepSeek-V3 / HF compute them."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    scaling = cfg.rope_scaling
    if scaling is None or scaling.get("type") == "default":
        return extrapolation, 1.0
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32.0
    beta_slow = scaling.get("beta_slow") or 1.0
    low = math.floor(_correction_dim(beta_fast, dim, base, original))
    high = math.ceil(_correction_dim(beta_slow, dim, base, original))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # Pairs below `low` rotate fast enough to keep their frequencies; pairs above `high` are interpolated.
    keep = 1.0 - ramp
    inv_freq = extrapolation * keep + (extrapolation / factor) * (1.0 - keep)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if scaling.get("attention_factor") is not None:
        amplitude = float(scaling["attention_factor"])
    elif mscale and mscale_all_dim:
        amplitude = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        amplitude = yarn_mscale(factor)
    return inv_freq, amplitude


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek-V3)."""
    scale = cfg.qk_head_dim ** -0.5
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.get("type") != "default" and scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    """Computes cos/sin tables [B, T, R/2] for given positions."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inv_freq, amplitude = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.amplitude = amplitude

    def reset(self, cfg: ModelConfig) -> None:
        """Recompute the frequencies and amplitude for `cfg` in place (a training stage switching RoPE/YaRN)."""
        inv_freq, self.amplitude = rope_inv_freq(cfg)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].float() * self.inv_freq  # [B, T, R/2]
        return angles.cos() * self.amplitude, angles.sin() * self.amplitude


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [B, H, T, R] (or [B, 1, T, R]) by per-position angles; cos/sin are [B, T, R/2].

    With `interleaved`, the weights store rotary pairs as (x0, x1), (x2, x3), ...; otherwise as the two halves.
    The output is always laid out as halves (first the rotated first members, then the second members): q and k
    get the same layout, so their dot products are those of the in-place rotation.
    """
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
