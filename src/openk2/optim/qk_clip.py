"""Per-head QK-Clip (K2 report, Algorithm 1): after the optimizer step, rescale the query/key weights of every
head whose max pre-softmax logit S_max^h exceeded tau so that its logits shrink by exactly gamma_h = tau / S_max^h.

MLA rule (a head's logit is q^C.k^C + q^R.k^R): q^C and k^C rows by sqrt(gamma_h), the head's own q^R rows by
gamma_h; the rope key k^R is shared by all heads and stays untouched, as do V, q_a_proj and the latent norms.
Plain multi-head attention: the head's q and k rows (and biases) by sqrt(gamma_h). Grouped-query attention
(a k head serves several q heads): the q rows by gamma_h and k untouched, which is exact per q head and leaves
the other heads of the group alone. Optimizer state (momentum) is never touched.
The model is seen only through this protocol: `model.attention_layers()` (or a list given explicitly) returns
modules that either have MLA's `kv_b_proj` (+ `q_b_proj` or `q_proj`, `num_heads`, `nope_dim`, `rope_dim`,
`v_dim`) or MHA's `q_proj`/`k_proj` (+ `num_heads`, `head_dim`, optional `num_key_value_heads`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from openk2.config import ModelConfig


def unrecorded_max_logits(config: ModelConfig) -> torch.Tensor:
    """[L, H] of -inf: the max logits of a step whose forwards recorded none (QK-Clip leaves every head alone)."""
    return torch.full((config.num_hidden_layers, config.num_attention_heads), float("-inf"))


def reduce_max_logits(max_logits: torch.Tensor, group=None) -> torch.Tensor:
    """MAX-reduce the probe's [L, H] tensor across data-parallel ranks (identity when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        max_logits = max_logits.clone()
        dist.all_reduce(max_logits, op=dist.ReduceOp.MAX, group=group)
    return max_logits


@torch.no_grad()
def _scale_rows(weight: torch.Tensor, scale_HR: torch.Tensor) -> None:
    # weight rows are grouped per head: [H * R, in] viewed as [H, R, in]; scaled in fp32, stored back.
    num_heads, rows = scale_HR.shape
    view = weight.view(num_heads, rows, -1)
    view.copy_((view.float() * scale_HR[..., None]).to(weight.dtype))


class QKClip:
    """Clips attention heads whose recorded max logit exceeds `tau` (weights edited in place)."""

    def __init__(self, model: nn.Module | None = None, tau: float = 100.0,
                 attention_layers: Sequence[nn.Module] | None = None, process_group=None) -> None:
        if tau <= 0:
            raise ValueError(f"QK-Clip threshold tau must be positive, got {tau}")
        if attention_layers is None:
            if model is None or not hasattr(model, "attention_layers"):
                raise ValueError("QKClip needs a model with attention_layers() or an explicit attention_layers list")
            attention_layers = model.attention_layers()
        self.layers = list(attention_layers)
        for layer in self.layers:
            if not (hasattr(layer, "kv_b_proj") or (hasattr(layer, "q_proj") and hasattr(layer, "k_proj"))):
                raise ValueError(f"{type(layer).__name__} is neither MLA (kv_b_proj) nor MHA (q_proj/k_proj)")
        self.tau = float(tau)
        self.process_group = process_group

    @torch.no_grad()
    def apply(self, max_logits: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """Clip from the probe's [L, H] max logits (MAX-reduced across ranks); returns gamma [L, H], 1 = untouched."""
        if max_logits.shape[0] != len(self.layers):
            raise ValueError(f"max_logits has {max_logits.shape[0]} layers, the model has {len(self.layers)}")
        max_logits = max_logits.float()
        if reduce:
            max_logits = reduce_max_logits(max_logits, self.process_group)
        gamma = torch.where(max_logits > self.tau, self.tau / max_logits, torch.ones_like(max_logits))
        for layer, gamma_h in zip(self.layers, gamma, strict=True):
            if (gamma_h < 1).any():
                if hasattr(layer, "kv_b_proj"):
                    self._clip_mla(layer, gamma_h)
                else:
                    self._clip_mha(layer, gamma_h)
        return gamma

    @staticmethod
    def _clip_mla(layer: nn.Module, gamma_h: torch.Tensor) -> None:
        device = layer.kv_b_proj.weight.device
        g = gamma_h.to(device)
        root = g.sqrt()[:, None]
        q_scale = torch.cat([root.expand(-1, layer.nope_dim), g[:, None].expand(-1, layer.rope_dim)], dim=1)
        q_weight = layer.q_b_proj.weight if hasattr(layer, "q_b_proj") else layer.q_proj.weight
        _scale_rows(q_weight, q_scale)
        kv_scale = torch.cat([root.expand(-1, layer.nope_dim), torch.ones(len(g), layer.v_dim, device=device)], 1)
        _scale_rows(layer.kv_b_proj.weight, kv_scale)

    @staticmethod
    def _clip_mha(layer: nn.Module, gamma_h: torch.Tensor) -> None:
        num_heads = layer.num_heads
        num_kv = getattr(layer, "num_key_value_heads", num_heads)
        head_dim = layer.head_dim
        g = gamma_h.to(layer.q_proj.weight.device)
        q_factor = g.sqrt() if num_kv == num_heads else g
        for proj, factor in ((layer.q_proj, q_factor), (layer.k_proj, g.sqrt() if num_kv == num_heads else None)):
            if factor is None:
                continue  # GQA: keys are shared across heads, so the whole factor goes on the queries
            scale = factor[:, None].expand(-1, head_dim)
            _scale_rows(proj.weight, scale)
            if proj.bias is not None:
                _scale_rows(proj.bias.view(-1, 1), scale)
