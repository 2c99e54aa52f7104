"""The attention core (short attention; fused SDPA with MLA's unequal head dims) and the blockwise max-logit probe,
against the explicit softmax(QK^T)V and the explicit max over [B, H, T, S] logits."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from openk2.model.attention import segment_causal_mask
from openk2.model.attention_core import attend, attend_with_max, fused_attend, head_max_logits
from openk2.model.probed_attention import probed_attention
from openk2.model.short_attention import short_attention


def _explicit_logits(q, k, scale, mask):
    t, s = q.shape[2], k.shape[2]
    allowed = torch.ones(t, s, dtype=torch.bool).tril(s - t) if mask is None else mask
    dtype = torch.promote_types(q.dtype, torch.float32)  # the probe's policy: fp32 logits (fp64 stays fp64)
    return ((q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))


def _explicit_attention(q, k, v, scale, mask):
    return torch.softmax(_explicit_logits(q, k, scale, mask), dim=-1) @ v


def _masks(b, t, g):
    """None (causal), packed documents, and a random mask that keeps each query's own position."""
    segments = torch.sort(torch.randint(0, 4, (b, t), generator=g), dim=1).values
    random = (torch.rand(b, 1, t, t, generator=g) < 0.3) | torch.eye(t, dtype=torch.bool)
    return {"causal": None, "packed": segment_causal_mask(segments), "random": random}


def _probed_small_blocks(q, k, v, scale, mask):
    return probed_attention(q, k, v, scale, mask, rows=16, key_tile=8)[0]  # 37 rows divide into neither


KERNELS = {"attend": attend, "fused": fused_attend, "short": lambda *a: short_attention(*a)[0],
           "probed": _probed_small_blocks, "probed_one_block": lambda *a: probed_attention(*a)[0]}


@pytest.mark.parametrize("kind", ["causal", "packed", "random"])
@pytest.mark.parametrize("dims", [(12, 8), (8, 12), (10, 10)])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernels_match_explicit_softmax_forward_and_backward(kind, dims, kernel):
    g = torch.Generator().manual_seed(sum(dims) + len(kind))
    qk_dim, v_dim = dims
    if kernel.startswith("probed") and qk_dim < v_dim:
        pytest.skip("probed_attention needs q/k head dim >= v's (MLA: 192 >= 128)")
    b, h, t = 2, 3, 37
    q, k = (torch.randn(b, h, t, qk_dim, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, h, t, v_dim, generator=g, dtype=torch.float64)
    mask = _masks(b, t, g)[kind]
    grad_out = torch.randn(b, h, t, v_dim, generator=g, dtype=torch.float64)
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _explicit_attention(*ref_inputs, 0.3, mask)
    ref.backward(grad_out)
    inputs = [x.float().requires_grad_() for x in (q, k, v)]
    out = KERNELS[kernel](*inputs, 0.3, mask)
    out.backward(grad_out.float())
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)  # fp32 against fp64
    for x, x_ref in zip(inputs, ref_inputs, strict=True):
        torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=1e-4, atol=1e-5)


def test_attend_runs_on_the_flash_kernel_with_mla_head_dims():
    """With v's dim unequal to q/k's, SDPA alone would fall back to its math kernel; restricted to flash,
    that raises. The padded call must pass, causal and masked, forward and backward."""
    q, k = torch.randn(1, 2, 64, 24, requires_grad=True), torch.randn(1, 2, 64, 24, requires_grad=True)
    v = torch.randn(1, 2, 64, 16, requires_grad=True)
    mask = segment_causal_mask(torch.tensor([[0] * 20 + [1] * 44]))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        with pytest.raises(RuntimeError):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        fused_attend(q, k, v, 0.2).sum().backward()
        fused_attend(q, k, v, 0.2, mask).sum().backward()


@pytest.mark.parametrize("kind", ["causal", "packed", "random"])
@pytest.mark.parametrize("t", [1, 17, 50])
def test_probe_equals_the_explicit_max(kind, t):
    g = torch.Generator().manual_seed(t)
    b, h = 3, 4
    q, k = torch.randn(b, h, t, 12, generator=g) * 3, torch.randn(b, h, t, 12, generator=g)
    mask = _masks(b, t, g)[kind]
    expected = _explicit_logits(q, k, 0.7, mask).amax(dim=(0, 2, 3))
    # block_bytes=0 gives the minimum block (16 rows): 17 and 50 rows do not divide into it. The same fp32
    # products, but BLAS may sum a [16, S] block in another order than the whole [T, S]: a few ulp (2^-20).
    for block_bytes in (0, 1 << 20):
        got = head_max_logits(q, k, 0.7, mask, block_bytes=block_bytes)
        torch.testing.assert_close(got, expected, rtol=2**-20, atol=0)


def test_probe_causal_with_more_keys_than_queries_and_half_precision_inputs():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, 21, 8, generator=g), torch.randn(2, 3, 40, 8, generator=g)
    expected = _explicit_logits(q, k, 0.5, None).amax(dim=(0, 2, 3))
    torch.testing.assert_close(head_max_logits(q, k, 0.5, None, block_bytes=0), expected, rtol=2**-20, atol=0)
    q16, k16 = q.bfloat16(), k.bfloat16()  # the probe's dtype policy: fp32 logits from the stored inputs
    expected16 = _explicit_logits(q16, k16, 0.5, None).amax(dim=(0, 2, 3))
    got16 = head_max_logits(q16, k16, 0.5, None, block_bytes=0)
    assert got16.dtype == torch.float32
    torch.testing.assert_close(got16, expected16, rtol=2**-20, atol=0)


def test_probe_of_a_fully_masked_head_is_minus_infinity():
    q, k = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    mask = torch.zeros(1, 1, 5, 5, dtype=torch.bool)
    assert head_max_logits(q, k, 1.0, mask).isneginf().all()


@pytest.mark.parametrize("kind", ["causal", "packed", "random"])
@pytest.mark.parametrize("t", [1, 33, 70])
def test_fused_probe_returns_the_explicit_max(kind, t):
    g = torch.Generator().manual_seed(t + 7)
    q, k = torch.randn(2, 4, t, 12, generator=g) * 3, torch.randn(2, 4, t, 12, generator=g)
    v = torch.randn(2, 4, t, 8, generator=g)
    mask = _masks(2, t, g)[kind]
    expected = _explicit_logits(q, k, 0.7, mask).amax(dim=(0, 2, 3))
    for rows, key_tile in ((16, 8), (16, 24), (128, 1024)):  # 33 and 70 divide into none; one tile
        _, got = probed_attention(q, k, v, 0.7, mask, rows=rows, key_tile=key_tile)
        torch.testing.assert_close(got, expected, rtol=2**-20, atol=0)
    for out, got in (attend_with_max(q, k, v, 0.7, mask), short_attention(q, k, v, 0.7, mask, need_max=True)):
        torch.testing.assert_close(got, expected, rtol=2**-20, atol=0)
        torch.testing.assert_close(out, _explicit_attention(q, k, v, 0.7, mask), rtol=1e-5, atol=1e-5)


def test_fused_probe_bf16_inputs_match_sdpa_and_keep_fp32_max():
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 2, 40, 16, generator=g).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(1, 2, 40, 8, generator=g).bfloat16().requires_grad_()
    out, head_max = probed_attention(q, k, v, 0.25)
    assert out.dtype == torch.bfloat16 and head_max.dtype == torch.float32
    torch.testing.assert_close(head_max, _explicit_logits(q, k, 0.25, None).amax(dim=(0, 2, 3)), rtol=2**-20, atol=0)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref = attend(q, k, v, 0.25)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)  # bf16 outputs: one bf16 rounding apart
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


def test_probed_attention_rejects_what_it_cannot_do():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="head dim"):
        probed_attention(q, q, torch.randn(1, 1, 4, 12), 1.0)
    with pytest.raises(ValueError, match="as many queries as keys"):
        probed_attention(q, torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8), 1.0)


def test_short_path_below_the_key_threshold_and_fused_kernel_above(monkeypatch):
    import openk2.model.attention_core as core

    calls = []
    real = core.short_attention
    monkeypatch.setattr(core, "short_attention", lambda *a, **kw: calls.append(a[1].shape[2]) or real(*a, **kw))
    monkeypatch.setattr(core, "SHORT_MAX_KEYS", 32)
    q, v = torch.randn(1, 2, 32, 12).bfloat16(), torch.randn(1, 2, 32, 8).bfloat16()
    attend(q, q, v, 0.3)
    attend_with_max(q, q, v, 0.3)
    assert calls == [32, 32]
    attend(q.float(), q.float(), v.float(), 0.3)  # fp32 keeps the fused kernel
    q, v = torch.randn(1, 2, 33, 12).bfloat16(), torch.randn(1, 2, 33, 8).bfloat16()
    attend(q, q, v, 0.3)
    attend_with_max(q, q, v, 0.3)
    attend(q[:, :, :5], q[:, :, :20], v[:, :, :20], 0.3)  # causal with fewer queries than keys: SDPA's convention
    assert calls == [32, 32]


def test_short_attention_bf16_matches_the_fused_kernel():
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 4, 64, 48, generator=g).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(2, 4, 64, 32, generator=g).bfloat16().requires_grad_()
    grad_out = torch.randn(2, 4, 64, 32, generator=g).bfloat16()
    results = []
    for fn in (lambda *a: short_attention(*a)[0], fused_attend):
        out = fn(q, k, v, 0.15)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    for a, b in zip(*results, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # each a bf16 rounding or two from the other


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_attention_leaves_the_incoming_gradient_alone(dtype):
    q = torch.randn(1, 2, 16, 12).to(dtype).requires_grad_()
    v = torch.randn(1, 2, 16, 8).to(dtype).requires_grad_()
    grad_out = torch.randn(1, 2, 16, 8).to(dtype)
    before = grad_out.clone()
    torch.autograd.grad(short_attention(q, q, v, 0.3)[0], (q, v), grad_out)
    assert torch.equal(grad_out, before)
