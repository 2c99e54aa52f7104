"""Multi-head Latent Attention (DeepSeek-V2/V3), with the per-head max-logit probe that QK-Clip needs.

The layer computes q and the compressed KV; its attention core is the training-time SDPA over expanded keys
unless an `InnerAttention` is passed (the inference engine's latent-cache attention). The core and the
probe live in `attention_core` (fused kernels, no [T, S] score tensor).

Shape legend: B batch, T query length, S key length, H heads, D hidden, C kv_lora_rank (latent),
N qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from openk2.config import ModelConfig
from openk2.model.attention_core import attend, attend_with_max, head_max_logits
from openk2.model.layers import RMSNorm
from openk2.model.rope import apply_rope, softmax_scale
from openk2.model.stats import ForwardStats


def segment_causal_mask(segment_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool attention mask (True = may attend): causal, and only within a token's own segment,
    so documents packed into one row do not see each other."""
    t = segment_ids_BT.shape[1]
    causal_TT = torch.ones(t, t, dtype=torch.bool, device=segment_ids_BT.device).tril()
    same_BTT = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    return (same_BTT & causal_TT).unsqueeze(1)


class InnerAttention(Protocol):
    """A pluggable attention core for MLAttention (the seam the inference engine's latent cache uses): from q^C
    [B, H, T, N], q^R [B, H, T, R] (no rope yet), the latent c [B, T, C] and k^R [B, 1, T, R] (no rope yet) to
    the per-head outputs [B, T, H*V] before o_proj. `attn` gives access to the layer's weights and index."""

    def __call__(self, attn: MLAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, latent_BTC: torch.Tensor,
                 k_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...


class MLAttention(nn.Module):
    """q = q_b(norm(q_a(x))) (or q_proj(x)); latent c = norm(kv_a(x)[:C]), shared rope key k^R = kv_a(x)[C:];
    per-head [k^C, v] = kv_b(c); logits = (q^C.k^C + q^R.k^R) * softmax_scale."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.rope_interleave = cfg.rope_interleave
        self.scale = softmax_scale(cfg)
        d, h, qk = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=bias)

    def query(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Per-head queries [B, H, T, N+R] before rope."""
        if hasattr(self, "q_proj"):
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        b, t, _ = x_BTD.shape
        return q.view(b, t, self.num_heads, -1).transpose(1, 2)

    def latent(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed KV: normalised latent c [B, T, C] and the shared rope key k^R [B, 1, T, R] (no rope)."""
        c, k_rope = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(c), k_rope.unsqueeze(1)

    def expand(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent_BTC: torch.Tensor, k_rope: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rope on q^R and k^R, per-head [k^C, v] from kv_b_proj: q [B, H, T, N+R], k [B, H, S, N+R], v [B, H, S, V]."""
        b, t, _ = latent_BTC.shape
        q_rope = apply_rope(q_rope, cos, sin, self.rope_interleave)
        k_rope = apply_rope(k_rope, cos, sin, self.rope_interleave)
        kv = self.kv_b_proj(latent_BTC).view(b, t, self.num_heads, -1).transpose(1, 2)
        k_nope, v_BHSV = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_BHTK = torch.cat((q_nope, q_rope), dim=-1)
        k_BHSK = torch.cat((k_nope, k_rope.expand(-1, self.num_heads, -1, -1)), dim=-1)
        return q_BHTK, k_BHSK, v_BHSV

    def qkv(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Per-head q [B, H, T, N+R], k [B, H, S, N+R] (rope applied, k^R broadcast) and v [B, H, S, V]."""
        q_nope, q_rope = self.query(x_BTD).split([self.nope_dim, self.rope_dim], dim=-1)
        return self.expand(q_nope, q_rope, *self.latent(x_BTD), cos, sin)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        stats: ForwardStats | None = None,
        inner_attention: InnerAttention | None = None,
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. `attn_mask` [B, 1, T, T] bool (True = may attend) replaces the causal mask;
        `stats` (when tracking) receives the per-head max logits; `inner_attention` replaces the attention core
        (it then owns masking, and records nothing)."""
        q_nope, q_rope = self.query(x_BTD).split([self.nope_dim, self.rope_dim], dim=-1)
        latent_BTC, k_rope = self.latent(x_BTD)
        if inner_attention is None:
            out_BTX = self.sdpa(q_nope, q_rope, latent_BTC, k_rope, cos, sin, attn_mask, stats)
        else:
            if attn_mask is not None:
                raise ValueError("an inner_attention does its own masking: pass no attn_mask with it")
            out_BTX = inner_attention(self, q_nope, q_rope, latent_BTC, k_rope, cos, sin)
        return self.o_proj(out_BTX)

    def sdpa(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent_BTC: torch.Tensor, k_rope: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None = None,
             stats: ForwardStats | None = None) -> torch.Tensor:
        """The training-time core: expanded keys and values, fused SDPA (causal unless `attn_mask`, no [T, S]
        scores: `attention_core`), the per-head max logit beside it when `stats` tracks it; [B, T, H*V]."""
        b, t, _ = latent_BTC.shape
        q_BHTK, k_BHSK, v_BHSV = self.expand(q_nope, q_rope, latent_BTC, k_rope, cos, sin)
        if stats is not None and stats.track_max_logits:
            # The probe fused with the attention where it is free (CPU); a recompute replay runs the same kernel
            # (the checkpoint checks it saves the same tensors) and records nothing.
            out, head_max = attend_with_max(q_BHTK, k_BHSK, v_BHSV, self.scale, attn_mask, need_max=not stats.replay)
            if not stats.replay:
                stats.record_max_logits(self.layer_idx, head_max)
        else:
            out = attend(q_BHTK, k_BHSK, v_BHSV, self.scale, attn_mask)
        return out.transpose(1, 2).reshape(b, t, -1)

    def head_max_logits(self, q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        """Each head's max scaled, masked pre-softmax logit [H] (fp32): the probe QK-Clip reads (blockwise over
        query rows, `attention_core.head_max_logits`)."""
        return head_max_logits(q, k, self.scale, attn_mask)
