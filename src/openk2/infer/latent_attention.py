"""MLA attention over the latent KV cache, and the engine's pluggable attention core built on it.

Two forms of the same attention over cached rows [c_j, k^R_j] (latent, then the roped shared key):

    absorbed:  scores_h[j] = ((q^C_h W_UK_h) . c_j + q^R_h . k^R_j) * scale,  out_h = W_UV_h sum_j p_h[j] c_j
    expanded:  per-head keys [k^C_h, k^R] and values v_h from kv_b_proj(c), then SDPA (the training-time form)

`LatentCacheAttention` is the `InnerAttention` the engine passes into the model's own layers: MLAttention computes
q and the latent as in training, then this stores the new latents in the cache and attends over each row's blocks.
Shape legend: B batch, T new tokens, S cached positions, H heads, C kv_lora_rank, N qk_nope_head_dim,
R qk_rope_head_dim, V v_head_dim, M tokens written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openk2.infer.kv_cache import PagedLatentCache
from openk2.model.attention import MLAttention
from openk2.model.rope import apply_rope


def _end_aligned_causal(t: int, s: int, device: torch.device) -> torch.Tensor:
    # The T queries are the last T of the S positions: query i sees keys 0 .. s - t + i.
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)


def absorbed_attention(
    attn: MLAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_BSX: torch.Tensor,
    mask_B1TS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of queries q^C [B, H, T, N], roped q^R [B, H, T, R] over a latent cache kv [B, S, C+R]
    (c then roped k^R), in the absorbed form; mask True = may attend, None = causal with the queries at the last
    T positions. Returns [B, T, H*V] (before o_proj)."""
    b, h, t, n = q_nope.shape
    c = attn.kv_lora_rank
    w_HXC = attn.kv_b_proj.weight.view(h, n + attn.v_dim, c)
    w_uk_HNC, w_uv_HVC = w_HXC[:, :n], w_HXC[:, n:]
    q_lat_BHTC = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk_HNC.to(q_nope.dtype))
    # One matmul scores the latent and rope parts together: the cache row [c_j, k^R_j] is shared by every head.
    q_BMX = (torch.cat((q_lat_BHTC, q_rope), dim=-1) * attn.scale).reshape(b, h * t, -1).to(kv_BSX.dtype)
    scores = torch.bmm(q_BMX, kv_BSX.transpose(1, 2)).view(b, h, t, -1).float()
    if mask_B1TS is None and t > 1:
        mask_B1TS = _end_aligned_causal(t, kv_BSX.shape[1], kv_BSX.device)
    if mask_B1TS is not None:
        scores = scores.masked_fill(~mask_B1TS, float("-inf"))
    probs = scores.softmax(dim=-1).to(kv_BSX.dtype)
    out_lat_BMC = torch.bmm(probs.view(b, h * t, -1), kv_BSX[..., :c])  # weighted sum in latent space
    out = torch.einsum("bhtc,hvc->bthv", out_lat_BMC.view(b, h, t, c).to(q_nope.dtype), w_uv_HVC.to(q_nope.dtype))
    return out.reshape(b, t, h * attn.v_dim)


def expanded_attention(
    attn: MLAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_BSX: torch.Tensor,
    mask_B1TS: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention with per-head keys [k^C_h, k^R] and values v_h expanded from the cache by kv_b_proj
    (the training-time form). Returns [B, T, H*V] (before o_proj)."""
    b, h, t, _ = q_nope.shape
    s = kv_BSX.shape[1]
    c = attn.kv_lora_rank
    latent, k_rope = kv_BSX[..., :c], kv_BSX[..., c:]
    kv = attn.kv_b_proj(latent.to(q_nope.dtype)).view(b, s, h, -1).transpose(1, 2)
    k_nope, v_BHSV = kv.split([attn.nope_dim, attn.v_dim], dim=-1)
    k_BHSK = torch.cat((k_nope, k_rope[:, None].to(q_nope.dtype).expand(b, h, s, -1)), dim=-1)
    q_BHTK = torch.cat((q_nope, q_rope), dim=-1)
    causal = mask_B1TS is None and t == s  # a fresh prefill: SDPA's fused causal kernel
    if mask_B1TS is None and 1 < t < s:
        mask_B1TS = _end_aligned_causal(t, s, kv_BSX.device)
    out = F.scaled_dot_product_attention(q_BHTK, k_BHSK, v_BHSV, attn_mask=mask_B1TS, is_causal=causal,
                                         scale=attn.scale)
    return out.transpose(1, 2).reshape(b, t, h * attn.v_dim)



@dataclass
class LatentCacheAttention:
    """The engine's attention core for one forward: write each layer's new (latent, roped key) rows into the
    paged cache, gather every row's first S positions back through its block table and attend over them
    (absorbed or expanded form)."""

    cache: PagedLatentCache
    write_rows_M: torch.Tensor  # cache row of each real new token
    valid_BT: torch.Tensor | None  # which new tokens are real (None: all of them)
    read_rows_BS: torch.Tensor  # cache row of positions 0..S-1 of each batch row (any row past its length)
    mask_B1TS: torch.Tensor | None  # True = may attend; None = causal, queries at the last T positions
    absorbed: bool = True

    def __call__(self, attn: MLAttention, q_nope: torch.Tensor, q_rope: torch.Tensor, latent_BTC: torch.Tensor,
                 k_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """InnerAttention: [B, T, H*V] before o_proj, after caching this layer's new rows."""
        # One rope call for the H query heads and the shared key (head H).
        roped = apply_rope(torch.cat((q_rope, k_rope), dim=1), cos, sin, attn.rope_interleave)
        q_rope, k_rope_BTR = roped[:, :-1], roped[:, -1]
        new_kv = torch.cat((latent_BTC, k_rope_BTR), dim=-1)
        rows = new_kv.flatten(0, 1) if self.valid_BT is None else new_kv[self.valid_BT]
        self.cache.write(attn.layer_idx, self.write_rows_M, rows)
        kv = self.cache.read(attn.layer_idx, self.read_rows_BS)
        mla = absorbed_attention if self.absorbed else expanded_attention
        return mla(attn, q_nope, q_rope, kv, self.mask_B1TS)
