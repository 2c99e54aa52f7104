"""Mean next-token cross-entropy over [N, V] logits in fp32, computed in row chunks, with a hand-written backward.

Why: `F.cross_entropy(logits.float(), targets)` makes three [N, V] fp32 tensors per step (the cast, the
log-softmax it saves for backward, the zero-filled gradient of the NLL) plus the cast's gradient. On CPU a
tensor that large is a fresh `mmap` each time, so writing it costs a page fault per 4 KiB page: at N 2048 and
V 4096 the loss took ~12% of a bf16 training step of the tiny preset, most of it first-touch of new memory
(docs/benchmarks.md, "Model forward+backward"). Here the fp32 work happens on `CHUNK_ROWS` rows at a time
(a few MiB the allocator reuses), only the per-row log-sum-exp is saved, and the backward writes
softmax - onehot straight into one gradient in the logits' dtype.

Same semantics as `F.cross_entropy(logits.float(), targets, ignore_index=-100)` with mean reduction: the mean
over targets != ignore_index (nan when there are none); differences are fp32 rounding (tests/model).
Shape legend: N tokens, V vocabulary, R rows per chunk.
"""

from __future__ import annotations

import torch

CHUNK_ROWS = 256  # rows of fp32 work at a time: 256 x 4096 x 4 B = 4 MiB, reused across chunks


def _chunks(n: int):
    for start in range(0, n, CHUNK_ROWS):
        yield start, min(n, start + CHUNK_ROWS)


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, targets_N: torch.Tensor, ignore_index: int) -> torch.Tensor:
        n, v = logits_NV.shape
        valid_N = targets_N != ignore_index
        safe_N = torch.where(valid_N, targets_N, 0)
        lse_N = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
        buf_RV = torch.empty(min(n, CHUNK_ROWS), v, dtype=torch.float32, device=logits_NV.device)  # reused
        for start, stop in _chunks(n):
            x_RV = buf_RV[:stop - start].copy_(logits_NV[start:stop])
            max_R = x_RV.amax(dim=-1, keepdim=True)
            lse_N[start:stop] = x_RV.sub_(max_R).exp_().sum(dim=-1).log_().add_(max_R.squeeze(1))
        target_logit_N = logits_NV.gather(1, safe_N[:, None]).squeeze(1).float()
        count = valid_N.sum()
        loss = torch.where(valid_N, lse_N - target_logit_N, 0.0).sum() / count
        ctx.save_for_backward(logits_NV, safe_N, valid_N, lse_N, count)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits_NV, safe_N, valid_N, lse_N, count = ctx.saved_tensors
        n, v = logits_NV.shape
        scale_N = torch.where(valid_N, grad_loss.float() / count, 0.0)
        minus_one_N = -valid_N.float()  # softmax - onehot at the target (ignored rows are scaled to 0 anyway)
        grad_NV = torch.empty_like(logits_NV)
        buf_RV = torch.empty(min(n, CHUNK_ROWS), v, dtype=torch.float32, device=logits_NV.device)
        for start, stop in _chunks(n):
            p_RV = buf_RV[:stop - start].copy_(logits_NV[start:stop]).sub_(lse_N[start:stop, None]).exp_()
            p_RV.scatter_add_(1, safe_N[start:stop, None], minus_one_N[start:stop, None])
            grad_NV[start:stop] = p_RV.mul_(scale_N[start:stop, None])
        return grad_NV, None, None


def cross_entropy(logits_NV: torch.Tensor, targets_N: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of `logits_NV` [N, V] (any float dtype, computed in fp32) against `targets_N` [N]
    (int64; `ignore_index` entries skipped), as `F.cross_entropy(logits.float(), targets)` in fewer passes."""
    if logits_NV.dim() != 2 or targets_N.shape != logits_NV.shape[:1]:
        raise ValueError(f"cross_entropy wants logits [N, V] and targets [N], got {tuple(logits_NV.shape)} "
                         f"and {tuple(targets_N.shape)}")
    return _FusedCrossEntropy.apply(logits_NV, targets_N, ignore_index)
