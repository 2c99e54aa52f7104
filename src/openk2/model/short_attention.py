"""Attention over a few hundred keys (CPU): softmax(q k^T) materialised, no padding of v, the max logit free.

At S <= SHORT_MAX_KEYS keys the [B, H, T, S] fp32 probabilities saved for backward are small (the issue-25
config, 8 sequences x 4 heads x 256 x 256: 8 MiB per layer; the CPU memory plan, train/parallel/activations.py,
already counts T x T probabilities per head on CPU), and three batched matmuls and one softmax beat the flash
kernel, which tiles the same work into [rows, keys] blocks, needs v padded to the q/k head dim (MLA: 32 -> 48 at
tiny) and recomputes the probabilities in backward. Forward + backward in bf16 measured 1.6x faster at 256 keys,
1.2-1.4x at 512 and 0.6x at 1,024 (fp32: 1.03x, 0.98x, 0.54x), so above SHORT_MAX_KEYS `attention_core.attend`
keeps the flash kernel, whose memory grows linearly (benchmarks/bench_short_attention.py, docs/benchmarks.md).

Precision: logits, softmax and the softmax gradient in fp32; P V, dV, dQ and dK as bf16 matmuls of the
bf16-rounded probabilities (gradients), as the CPU flash kernel does. The per-head max logit QK-Clip reads
(K2 report, Algorithm 1) is one `amax` over the logits already computed.

Shape legend: B batch, H heads, T query length, S key length, K q/k head dim, V v head dim.
"""

from __future__ import annotations

import torch

SHORT_MAX_KEYS = 512  # keys up to which `attend` takes this path on CPU (T^2 memory: see the docstring)


def causal_bias(t: int, s: int, device: torch.device) -> torch.Tensor:
    """[T, S] fp32: 0 where query i may see key j (j <= i + S - T), -inf elsewhere."""
    rows = torch.arange(t, device=device)[:, None] + (s - t)
    hidden = torch.arange(s, device=device)[None, :] > rows
    return torch.zeros(t, s, device=device).masked_fill_(hidden, float("-inf"))


class _ShortAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHTK, k_BHSK, v_BHSV, scale, bias, need_max):
        b, h, t, _ = q_BHTK.shape
        s = k_BHSK.shape[2]
        with torch.autocast(q_BHTK.device.type, enabled=False):
            # scale * (q k^T) + mask bias in one BLAS call: the bias is the output buffer's start (beta = 1).
            logits = torch.baddbmm(bias.expand(b, h, t, s).reshape(b * h, t, s), q_BHTK.float().reshape(b * h, t, -1),
                                   k_BHSK.float().reshape(b * h, s, -1).transpose(-1, -2), alpha=scale).view(b, h, t, s)
            head_max = logits.amax(dim=(0, 2, 3)) if need_max else None
            probs = torch.softmax(logits, dim=-1)
            del logits
            out = torch.matmul(probs.to(v_BHSV.dtype), v_BHSV)
        ctx.scale = scale
        ctx.save_for_backward(q_BHTK, k_BHSK, v_BHSV, probs, out)
        if head_max is not None:
            ctx.mark_non_differentiable(head_max)
        return out, head_max

    @staticmethod
    def backward(ctx, grad_out, _grad_max):
        q, k, v, probs, out = ctx.saved_tensors
        dtype = v.dtype
        with torch.autocast(q.device.type, enabled=False):
            grad_out = grad_out.to(dtype)
            grad_v = torch.matmul(probs.to(dtype).transpose(-1, -2), grad_out)
            # dL/dlogits = P * (dP - rowsum(dO * O)) (softmax's gradient) times the scale (for q and k), the scale
            # applied to the [B, H, T, V] dO rather than to the [B, H, T, S] product.
            grad_scaled = grad_out.float() * ctx.scale  # not in place: for fp32, .float() is grad_out itself
            grad_p = torch.matmul(grad_scaled, v.float().transpose(-1, -2))
            delta = (grad_scaled * out.float()).sum(-1, keepdim=True)
            grad_logits = grad_p.sub_(delta).mul_(probs).to(dtype)
            del grad_p
            grad_q = torch.matmul(grad_logits, k)
            grad_k = torch.matmul(grad_logits.transpose(-1, -2), q)
        return grad_q, grad_k, grad_v, None, None, None


def short_attention(q_BHTK: torch.Tensor, k_BHSK: torch.Tensor, v_BHSV: torch.Tensor, scale: float,
                    attn_mask: torch.Tensor | None = None,
                    need_max: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(q k^T * scale + mask) v [B, H, T, V] and, if `need_max`, each head's max scaled, masked logit [H]
    (fp32; else None); causal (query i sees keys up to i + S - T) unless `attn_mask` [B, 1, T, S] bool (True =
    may attend). A row with no visible key gives NaN, as an explicit softmax does."""
    t, s = q_BHTK.shape[2], k_BHSK.shape[2]
    if attn_mask is None:
        bias = causal_bias(t, s, q_BHTK.device)
    else:
        bias = torch.zeros(attn_mask.shape, device=q_BHTK.device).masked_fill_(~attn_mask, float("-inf"))
    return _ShortAttention.apply(q_BHTK, k_BHSK, v_BHSV, scale, bias, need_max)
