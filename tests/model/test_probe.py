"""The max-logit probe QK-Clip reads: per-head max of scaled, causally masked pre-softmax logits."""

import torch

from openk2 import K2ForCausalLM
from openk2.model import ForwardStats

from .conftest import small_config


def _explicit_max_logits(attn, x, cos, sin):
    q, k, _ = attn.qkv(x, cos, sin)
    t = x.shape[1]
    logits = (q @ k.transpose(-1, -2)) * attn.scale
    logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return logits.amax(dim=(0, 2, 3))


def test_probe_matches_explicit_logits_and_accumulates():
    torch.manual_seed(0)
    model = K2ForCausalLM(small_config(initializer_range=0.2)).eval()
    ids = torch.randint(0, 97, (2, 13))
    stats = ForwardStats(model.config)
    assert stats.max_logits().isinf().all()  # off by default: nothing recorded
    model(ids, stats=stats)
    assert stats.max_logits().isinf().all()

    with torch.no_grad():
        stats = ForwardStats(model.config, track_max_logits=True)
        model(ids, stats=stats)
        first = stats.max_logits()
        assert first.shape == (3, 4)
        stats = ForwardStats(model.config, track_max_logits=True)
        model(ids[:1], stats=stats)
        model(ids[1:], stats=stats)
        both = stats.max_logits()  # max-accumulated over two calls equals one call on both
        torch.testing.assert_close(both, first)

        # Layer 0 against an explicit computation from the same weights and inputs.
        attn = model.model.layers[0].self_attn
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        cos, sin = model.model.rotary_emb(torch.arange(13).expand(2, 13))
        torch.testing.assert_close(first[0], _explicit_max_logits(attn, x, cos, sin), rtol=1e-5, atol=1e-5)
    stats = ForwardStats(model.config)
    model(ids, stats=stats)
    assert stats.max_logits().isinf().all()
