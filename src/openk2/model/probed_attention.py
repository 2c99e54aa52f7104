"""Attention that returns each head's max logit beside its output (CPU): the probe fused with the forward.

Forward: over tiles of query rows x keys (causal: only keys up to the block's last row), the scaled fp32
logits [H, rows, key_tile] and an online softmax (FlashAttention's running row max, sum and output); the
final running max is each row's max logit (the probe's S_max), and the row log-sum-exp is kept. Backward:
ATen's CPU flash-attention backward, fed this forward's output and log-sum-exp, so gradients are those of
`F.scaled_dot_product_attention` on the fused kernel, with no [H, T, S] tensor either way. The max logit thus
costs nothing beyond the forward's own QK^T, where a separate probe repeats it (benchmarks/bench_probe.py --core).

Shape legend: B batch, H heads, T query length, S key length, K q/k head dim, V v head dim, R block rows.
(A row with no visible key gives NaN, as the explicit softmax does.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tiles of query rows x keys: [H, ROWS, KEY_TILE] fp32 logits (4 MiB at 8 heads) stay near the cache, where
# whole key rows ([H, rows, S]) made the 16k forward 2.5x slower than the fused kernel (docs/benchmarks.md).
ROWS = 128
KEY_TILE = 1024


@torch.no_grad()
def _forward(q_BHTK: torch.Tensor, k_BHSK: torch.Tensor, v_BHSV: torch.Tensor, scale: float,
             attn_mask: torch.Tensor | None, rows: int, key_tile: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out [B, H, T, V] (q's dtype), log-sum-exp [B, H, T] and per-head max logit [H] (fp32), by online
    softmax over key tiles: a running row max m, sum l and output accumulator, rescaled by exp(m_old - m)."""
    b, h, t, _ = q_BHTK.shape
    s, v_dim = k_BHSK.shape[2], v_BHSV.shape[-1]
    dev = q_BHTK.device
    out = torch.empty(b, h, t, v_dim, dtype=q_BHTK.dtype, device=dev)
    lse = torch.empty(b, h, t, dtype=torch.float32, device=dev)
    head_max = torch.full((h,), float("-inf"), device=dev)
    after_diag = torch.ones(rows, rows, dtype=torch.bool, device=dev).triu(1)  # causal: key after the row
    for i in range(b):
        k_HSK, v_HSV = k_BHSK[i].float(), v_BHSV[i].float()
        for start in range(0, t, rows):
            stop = min(t, start + rows)
            q_HRK = q_BHTK[i, :, start:stop].float()
            row_max = torch.full((h, stop - start, 1), float("-inf"), device=dev)
            total = torch.zeros(h, stop - start, 1, device=dev)
            acc = torch.zeros(h, stop - start, v_dim, device=dev)
            keys = s if attn_mask is not None else stop  # causal: later keys are never seen
            for k0 in range(0, keys, key_tile):
                k1 = min(keys, k0 + key_tile)
                logits = (q_HRK @ k_HSK[:, k0:k1].transpose(-1, -2)).mul_(scale)
                if attn_mask is not None:
                    logits.masked_fill_(~attn_mask[i, 0, start:stop, k0:k1], float("-inf"))
                elif k1 > start:  # the tile reaches the diagonal: its keys from `start` on may lie after a row
                    c0 = max(k0, start)
                    hidden = after_diag[:stop - start, c0 - start:k1 - start]
                    logits[..., c0 - k0:].masked_fill_(hidden, float("-inf"))
                new_max = torch.maximum(row_max, logits.amax(dim=-1, keepdim=True))
                shift = torch.where(new_max.isneginf(), 0.0, new_max)  # rows with nothing visible yet
                probs = logits.sub_(shift).exp_()
                rescale = (row_max - shift).exp_()
                total.mul_(rescale).add_(probs.sum(dim=-1, keepdim=True))
                acc.mul_(rescale).add_(probs @ v_HSV[:, k0:k1])
                row_max = new_max
            head_max = torch.maximum(head_max, row_max.amax(dim=(1, 2)))
            out[i, :, start:stop] = acc.div_(total)
            lse[i, :, start:stop] = (row_max + total.log()).squeeze(-1)
    return out, lse, head_max


class _ProbedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, attn_mask, rows, key_tile):
        with torch.autocast(q.device.type, enabled=False):
            out, lse, head_max = _forward(q, k, v, scale, attn_mask, rows, key_tile)
        ctx.scale, ctx.causal = scale, attn_mask is None
        ctx.save_for_backward(q, k, v, out, lse, attn_mask)
        ctx.mark_non_differentiable(head_max)
        return out, head_max

    @staticmethod
    def backward(ctx, grad_out, _grad_max):
        q, k, v, out, lse, attn_mask = ctx.saved_tensors
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        pad = qk_dim - v_dim  # the flash kernel wants one head dim: zero columns of v and out change nothing
        v_p, out_p, grad_p = (F.pad(x, (0, pad)) for x in (v, out, grad_out.to(out.dtype)))
        additive = None
        if attn_mask is not None:  # the kernel reads a float mask in q's dtype (SDPA converts the same way)
            additive = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
            additive.masked_fill_(~attn_mask, float("-inf"))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_p.contiguous(), q, k, v_p, out_p, lse, 0.0, ctx.causal, attn_mask=additive, scale=ctx.scale)
        return dq, dk, dv[..., :v_dim], None, None, None, None


def probed_attention(q_BHTK: torch.Tensor, k_BHSK: torch.Tensor, v_BHSV: torch.Tensor, scale: float,
                     attn_mask: torch.Tensor | None = None, rows: int = ROWS,
                     key_tile: int = KEY_TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + mask) v [B, H, T, V] and each head's max scaled, masked logit [H] (fp32), causal
    unless `attn_mask` [B, 1, T, S] bool (True = may attend); CPU, q/k head dim >= v's, T == S when causal."""
    if q_BHTK.device.type != "cpu":
        raise ValueError("probed_attention runs on CPU (its backward is ATen's CPU flash kernel)")
    if attn_mask is None and q_BHTK.shape[2] != k_BHSK.shape[2]:
        raise ValueError("probed_attention's causal mask needs as many queries as keys; pass an attn_mask")
    if q_BHTK.shape[-1] < v_BHSV.shape[-1]:
        raise ValueError("probed_attention needs the q/k head dim >= the v head dim")
    return _ProbedAttention.apply(q_BHTK, k_BHSK, v_BHSV, scale, attn_mask, rows, key_tile)
