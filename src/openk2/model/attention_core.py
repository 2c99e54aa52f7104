"""The training-time attention core and the max-logit probe; past a few hundred keys without a [T, S] tensor.

On CPU in bf16 with at most SHORT_MAX_KEYS keys, `attend` runs `short_attention`: the [T, S] probabilities are small
there and three matmuls beat the tiled kernel (short_attention.py). Otherwise it runs SDPA on a fused kernel
(flash on CPU and CUDA, memory-efficient with a mask on CUDA). Those kernels need equal q/k and v head dims,
which MLA does not have (K2: 192 and 128): with unequal dims SDPA falls back to its math kernel and
materialises softmax(QK^T) [B, H, T, S]. Zero-padding v to the q/k dim (zero columns of v give zero output
columns, cut off again) keeps the result and reaches the fused kernels for ~1.5x the P V work. Benchmarks:
benchmarks/bench_attention.py, benchmarks/bench_short_attention.py, docs/benchmarks.md.

`head_max_logits` is the probe QK-Clip reads (K2 report, Algorithm 1: S_max^h): each head's max scaled, masked
pre-softmax logit, computed in fp32 over blocks of query rows, skipping keys a causal mask hides, so its
temporary is [H, rows, S] (a bounded budget), never [H, T, S]. `attend_with_max` gives output and max at once:
on CPU one pass (`short_attention` or `probed_attention`: the max is a by-product of the forward's own logits),
elsewhere `attend` plus `head_max_logits`.

Shape legend: B batch, H heads, T query length, S key length, K q/k head dim, V v head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk2.model.probed_attention import probed_attention
from openk2.model.short_attention import SHORT_MAX_KEYS, short_attention

# Bytes of fp32 logits one probe block may hold: 64 MiB keeps the probe far below the attention's own
# activations at any length (16k keys, 8 heads: 128 query rows a block).
PROBE_BLOCK_BYTES = 64 << 20
MIN_PROBE_ROWS = 16  # below this, per-block Python overhead dominates (K2: 64 heads x 128k keys gives 2 rows)
MAX_PROBE_ROWS = 128  # causal blocks skip later keys: short blocks do ~(1 + rows / T) / 2 of the full QK^T


def takes_short_path(q_BHTK: torch.Tensor, k_BHSK: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    """Whether attention runs as `short_attention` rather than a fused SDPA kernel (`short_path_rule`)."""
    return short_path_rule(q_BHTK.device.type, q_BHTK.dtype, q_BHTK.shape[2], k_BHSK.shape[2], attn_mask is not None)


def short_path_rule(device_type: str, dtype: torch.dtype, queries: int, keys: int, masked: bool) -> bool:
    """`takes_short_path` on shapes (the memory plan asks it too): CPU, bf16, at most SHORT_MAX_KEYS keys, causal
    only when as many queries as keys, eager or compiled (traced into compiled blocks it measured 1.06-1.16x the
    compiled step with the flash kernel, docs/benchmarks.md; tests/model/test_compile.py checks it against eager).
    In fp32 it measured 0.85-1.12x the flash kernel at 128-512 keys, for more saved memory, so fp32 keeps the
    kernel."""
    return (device_type == "cpu" and dtype == torch.bfloat16 and keys <= SHORT_MAX_KEYS
            and (masked or queries == keys))


def attend(q_BHTK: torch.Tensor, k_BHSK: torch.Tensor, v_BHSV: torch.Tensor, scale: float,
           attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v [B, H, T, V], causal unless `attn_mask` [B, 1, T, S] bool (True = may
    attend); few keys on CPU in bf16: `short_attention`; else v is zero-padded to the q/k head dim (or q, k to v's) so
    SDPA can use a fused kernel."""
    if takes_short_path(q_BHTK, k_BHSK, attn_mask):
        return short_attention(q_BHTK, k_BHSK, v_BHSV, scale, attn_mask)[0]
    return fused_attend(q_BHTK, k_BHSK, v_BHSV, scale, attn_mask)


def fused_attend(q_BHTK: torch.Tensor, k_BHSK: torch.Tensor, v_BHSV: torch.Tensor, scale: float,
                 attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """`attend` on SDPA's fused kernels at any length: v zero-padded to the q/k head dim (or q, k to v's)."""
    qk_dim, v_dim = q_BHTK.shape[-1], v_BHSV.shape[-1]
    if v_dim < qk_dim:
        v_BHSV = F.pad(v_BHSV, (0, qk_dim - v_dim))
    elif qk_dim < v_dim:  # zero columns of q and k add nothing to the logits; the scale is passed explicitly
        q_BHTK, k_BHSK = F.pad(q_BHTK, (0, v_dim - qk_dim)), F.pad(k_BHSK, (0, v_dim - qk_dim))
    if attn_mask is None:
        out = F.scaled_dot_product_attention(q_BHTK, k_BHSK, v_BHSV, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q_BHTK, k_BHSK, v_BHSV, attn_mask=attn_mask, scale=scale)
    return out[..., :v_dim] if out.shape[-1] != v_dim else out


@torch.no_grad()
def head_max_logits(q_BHTK: torch.Tensor, k_BHSK: torch.Tensor, scale: float,
                    attn_mask: torch.Tensor | None = None,
                    block_bytes: int = PROBE_BLOCK_BYTES) -> torch.Tensor:
    """Each head's max of the scaled, masked logits q k^T * scale [H] (fp32), over blocks of query rows:
    causal (query i sees keys up to i + S - T) unless `attn_mask` [B, 1, T, S] bool; -inf for a head whose
    every logit is masked."""
    b, h, t, _ = q_BHTK.shape
    s = k_BHSK.shape[2]
    rows = min(MAX_PROBE_ROWS, max(MIN_PROBE_ROWS, block_bytes // (4 * h * s)))
    head_max = torch.full((h,), float("-inf"), device=q_BHTK.device)
    for i in range(b):
        k_HSK = k_BHSK[i].float()
        for start in range(0, t, rows):
            stop = min(t, start + rows)
            q_HRK = q_BHTK[i, :, start:stop].float()
            if attn_mask is None:
                keys = min(s, stop + s - t)  # keys past the block's last visible one are never looked at
                if keys <= 0:
                    continue
                logits_HRS = q_HRK @ k_HSK[:, :keys].transpose(-1, -2)
                row = torch.arange(start, stop, device=q_BHTK.device)[:, None]
                allowed_RS = torch.arange(keys, device=q_BHTK.device)[None, :] <= row + (s - t)
            else:
                logits_HRS = q_HRK @ k_HSK.transpose(-1, -2)
                allowed_RS = attn_mask[i, 0, start:stop]
            logits_HRS = (logits_HRS * scale).masked_fill_(~allowed_RS, float("-inf"))
            head_max = torch.maximum(head_max, logits_HRS.amax(dim=(1, 2)))
    return head_max


def attend_with_max(q_BHTK: torch.Tensor, k_BHSK: torch.Tensor, v_BHSV: torch.Tensor, scale: float,
                    attn_mask: torch.Tensor | None = None,
                    need_max: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attend` and each head's max scaled, masked logit [H] (fp32; None if not `need_max` and not free). On CPU
    one fused pass (`short_attention` for few keys, else `probed_attention`: the max is free); elsewhere `attend`
    plus the blockwise probe."""
    if takes_short_path(q_BHTK, k_BHSK, attn_mask):
        return short_attention(q_BHTK, k_BHSK, v_BHSV, scale, attn_mask, need_max=need_max)
    if q_BHTK.device.type == "cpu" and q_BHTK.shape[-1] >= v_BHSV.shape[-1] and (
            attn_mask is not None or q_BHTK.shape[2] == k_BHSK.shape[2]):
        return probed_attention(q_BHTK, k_BHSK, v_BHSV, scale, attn_mask)
    head_max = head_max_logits(q_BHTK, k_BHSK, scale, attn_mask) if need_max else None
    return attend(q_BHTK, k_BHSK, v_BHSV, scale, attn_mask), head_max
