"""The fused training-step ops equal the plain PyTorch ops they replace: the chunked cross-entropy with its
hand-written backward (model/fused_loss.py) and RMSNorm's fused forward with its closed-form backward
(model/rms_norm_fn.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openk2.model import fused_loss
from openk2.model.fused_loss import cross_entropy
from openk2.model.layers import RMSNorm


def _reference_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _loss_and_grad(fn, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.clone().requires_grad_()
    loss = fn(leaf, targets)
    (loss * 3.0).backward()  # a non-unit upstream gradient
    return loss.detach(), leaf.grad


def _plain(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=-100)


@pytest.mark.parametrize("n", [1, 300, 512])  # one row; rows that do not fill the last chunk; whole chunks
def test_cross_entropy_matches_torch_fp32(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    logits = torch.randn(n, 97, generator=gen) * 4
    targets = torch.randint(0, 97, (n,), generator=gen)
    targets[::7] = -100
    if n == 1:
        targets[0] = 5
    loss, grad = _loss_and_grad(cross_entropy, logits, targets)
    ref_loss, ref_grad = _loss_and_grad(_plain, logits, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-9)
    if n > 1:
        assert grad[::7].abs().sum() == 0  # ignored rows get no gradient


def test_cross_entropy_bf16_logits_gradient_in_bf16() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(300, 64, generator=gen) * 3).bfloat16()
    targets = torch.randint(0, 64, (300,), generator=gen)
    loss, grad = _loss_and_grad(cross_entropy, logits, targets)
    ref_loss, ref_grad = _loss_and_grad(_plain, logits, targets)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=1e-2, atol=1e-7)  # one bf16 rounding


def test_cross_entropy_chunk_size_does_not_change_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(2)
    logits, targets = torch.randn(50, 33, generator=gen), torch.randint(0, 33, (50,), generator=gen)
    whole = _loss_and_grad(cross_entropy, logits, targets)
    monkeypatch.setattr(fused_loss, "CHUNK_ROWS", 7)
    chunked = _loss_and_grad(cross_entropy, logits, targets)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-9)


def test_cross_entropy_all_ignored_is_nan_like_torch() -> None:
    targets = torch.full((4,), -100)
    assert torch.isnan(cross_entropy(torch.randn(4, 5), targets))
    assert torch.isnan(_plain(torch.randn(4, 5), targets))


def test_cross_entropy_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="logits \\[N, V\\]"):
        cross_entropy(torch.randn(2, 3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="targets \\[N\\]"):
        cross_entropy(torch.randn(2, 3), torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [16, 256, 1000])
def test_rmsnorm_is_bit_identical_to_the_formula(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    norm = RMSNorm(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=gen))
    x = (torch.randn(3, 5, width, generator=gen) * 3).to(dtype)
    upstream = torch.randn(3, 5, width, generator=gen).to(dtype)
    outs, grads = [], []
    for fn in (norm, lambda v: _reference_rms(v, norm.weight, norm.eps)):
        leaf = x.clone().requires_grad_()
        norm.weight.grad = None
        out = fn(leaf)
        out.backward(upstream)
        outs.append(out.detach())
        grads.append((leaf.grad, norm.weight.grad.clone()))
    assert torch.equal(outs[0], outs[1])
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-3}
    torch.testing.assert_close(grads[0][0], grads[1][0], **tol)  # the closed form, up to rounding
    torch.testing.assert_close(grads[0][1], grads[1][1], **tol)


def test_rmsnorm_without_gradients_is_the_same_forward() -> None:
    norm = RMSNorm(64).to(torch.bfloat16)
    x = torch.randn(4, 64).bfloat16()
    with torch.no_grad():
        plain = norm(x)
    assert torch.equal(plain, norm(x.requires_grad_()).detach())
