"""Next-token cross-entropy over the vocabulary in chunks of tokens, so [N, V] logits never exist whole.

The plain loss materialises the logits [N, V] in the compute dtype, an fp32 copy, and log-softmax saved for
backward: at N = 32k tokens and K2's V = 163,840 that is ~60 GB. Here each chunk of C tokens runs
lm_head -> fp32 -> cross-entropy under activation checkpointing: the forward keeps only the chunk's scalar
loss, and backward recomputes that chunk's logits, so at most one [C, V] block (and its gradient) is alive.
The price is one extra lm_head matmul per token in backward. Per-element arithmetic equals the plain path's
(same matmul, same casts, same cross-entropy); only the order in which chunk sums and weight-gradient
contributions are added differs. Shape legend: N tokens, D hidden, V vocab, C tokens per chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_cross_entropy"]


def _chunk_loss_sum(hidden_CD: torch.Tensor, weight_VD: torch.Tensor, targets_C: torch.Tensor,
                    ignore_index: int) -> torch.Tensor:
    """Summed cross-entropy of one chunk: logits in the caller's (autocast) dtype, the softmax in fp32."""
    logits_CV = F.linear(hidden_CD, weight_VD)
    return F.cross_entropy(logits_CV.float(), targets_C, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    chunk_tokens: int = 4096,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight^T` against `targets` over non-ignored tokens, `chunk_tokens` rows
    of logits at a time (equal to F.cross_entropy on the full logits up to summation order)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden_ND.ndim != 2 or targets_N.shape != hidden_ND.shape[:1]:
        raise ValueError(f"expected hidden [N, D] and targets [N], got {tuple(hidden_ND.shape)} and "
                         f"{tuple(targets_N.shape)}")
    total = hidden_ND.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden_ND.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(_chunk_loss_sum, hidden_ND[start:end], weight_VD, targets_N[start:end],
                                   ignore_index, use_reentrant=False)
    # Like F.cross_entropy's mean: divided by the non-ignored count (0/0 = nan when every token is ignored).
    return total / (targets_N != ignore_index).sum()
