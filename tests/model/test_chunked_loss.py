"""Chunked cross-entropy: equal to the plain loss (values and gradients), and no [N, V] tensor kept for backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from openk2.model import K2ForCausalLM
from openk2.model.chunked_loss import chunked_cross_entropy
from tests.model.conftest import small_config


def _inputs(n: int = 37, d: int = 12, v: int = 50, seed: int = 0):
    """Random hidden [N, D] and weight [V, D] leaves, and targets [N] with some ignored (-100) tokens."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, requires_grad=True)
    weight = torch.randn(v, d, generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::5] = -100
    return hidden, weight, targets


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_equals_plain_cross_entropy_and_its_gradients(chunk):
    """Any chunk size (dividing N or not, larger than N) gives the plain loss and gradients to fp32 rounding."""
    hidden, weight, targets = _inputs()
    plain = F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=-100)
    g_hidden, g_weight = torch.autograd.grad(plain, (hidden, weight))
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_tokens=chunk)
    c_hidden, c_weight = torch.autograd.grad(loss, (hidden, weight))
    torch.testing.assert_close(loss, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(c_hidden, g_hidden, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(c_weight, g_weight, rtol=1e-5, atol=1e-7)


def test_no_full_logits_are_saved_for_backward():
    """What the forward keeps for backward is hidden- and weight-sized: never an [N, V] block of logits."""
    n, v = 64, 400
    hidden, weight, targets = _inputs(n=n, v=v)
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_tokens=16)
    assert sizes and max(sizes) <= weight.numel()  # checkpointed chunks keep only their inputs
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(F.linear(hidden, weight).float(), targets)
    assert max(sizes) >= n * v  # the hook does see the plain path's log-softmax: the check above can fail
    loss.backward()
    assert hidden.grad is not None and weight.grad is not None


def test_all_ignored_and_bad_arguments():
    """Every token ignored gives nan like F.cross_entropy; a chunk size below 1 and bad shapes are ValueErrors."""
    hidden, weight, targets = _inputs(n=6)
    targets[:] = -100
    assert torch.isnan(chunked_cross_entropy(hidden, weight, targets, chunk_tokens=4))
    assert torch.isnan(F.cross_entropy(F.linear(hidden, weight), targets))
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_cross_entropy(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="expected hidden"):
        chunked_cross_entropy(hidden[None], weight, targets)


def test_model_loss_in_chunks_equals_plain_loss():
    """K2ForCausalLM with loss_chunk_tokens set: same loss and gradients, and no logits in the output."""
    torch.manual_seed(0)
    plain = K2ForCausalLM(small_config(num_hidden_layers=2)).train()
    chunked = copy.deepcopy(plain)
    chunked.loss_chunk_tokens = 7  # 2 x 20 tokens: chunks that do not divide the batch
    ids = torch.randint(0, plain.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    out_p = plain(ids, labels=ids)
    out_c = chunked(ids, labels=ids)
    assert out_c.logits is None and out_p.logits is not None
    torch.testing.assert_close(out_c.loss, out_p.loss, rtol=1e-6, atol=1e-6)
    out_p.loss.backward()
    out_c.loss.backward()
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert chunked(ids).logits is not None  # without labels the logits are computed as usual
