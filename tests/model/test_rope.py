"""YaRN for K2's settings and the rope layouts."""

import math

import torch

from openk2.config import ModelConfig
from openk2.model.rope import apply_rope, rope_inv_freq, softmax_scale


def test_k2_yarn_frequencies_and_mscale():
    cfg = ModelConfig.preset("kimi-k2")  # rope dim 64, base 50000, factor 32, original 4096, beta 1/1
    inv_freq, amplitude = rope_inv_freq(cfg)
    base = 1.0 / 50000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    assert inv_freq.shape == (32,)
    assert torch.equal(inv_freq[:20], base[:20])  # pairs 0-19 keep their frequency
    torch.testing.assert_close(inv_freq[20:], base[20:] / 32)  # pairs 20-31 are interpolated
    assert amplitude == 1.0  # mscale == mscale_all_dim: the cos/sin amplitude cancels
    mscale = 1 + 0.1 * math.log(32)
    assert math.isclose(softmax_scale(cfg), 192 ** -0.5 * mscale**2, rel_tol=1e-12)


def test_no_scaling_is_plain_rope():
    cfg = ModelConfig.preset("tiny")
    inv_freq, amplitude = rope_inv_freq(cfg)
    expected = 1.0 / cfg.rope_theta ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    assert torch.equal(inv_freq, expected) and amplitude == 1.0
    assert softmax_scale(cfg) == cfg.qk_head_dim ** -0.5


def test_interleaved_and_halves_layouts_give_the_same_dot_products():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    angles = torch.arange(5.0)[None, :, None] * torch.rand(4)
    cos, sin = angles.cos(), angles.sin()
    # The same vectors stored interleaved ([x0, y0, x1, y1, ...]) or as halves ([x0, x1, ..., y0, y1, ...]).
    to_halves = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])
    inter = apply_rope(q, cos, sin, True) @ apply_rope(k, cos, sin, True).transpose(-1, -2)
    halves = apply_rope(q[..., to_halves], cos, sin, False) @ apply_rope(k[..., to_halves], cos, sin, False).mT
    torch.testing.assert_close(inter, halves)


def test_rope_is_relative():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    inv = torch.rand(4)

    def logit(pq, pk):
        cq, sq = (pq * inv).cos()[None, None], (pq * inv).sin()[None, None]
        ck, sk = (pk * inv).cos()[None, None], (pk * inv).sin()[None, None]
        return (apply_rope(q, cq, sq, True) * apply_rope(k, ck, sk, True)).sum()

    torch.testing.assert_close(logit(7.0, 3.0), logit(104.0, 100.0), rtol=1e-4, atol=1e-5)
