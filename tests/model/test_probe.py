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


def test_probe_runs_once_per_forward_under_recompute(monkeypatch):
    """Backward's replay of a checkpointed layer records into a throw-away collector marked `replay`: nothing
    is recorded twice, a separate probe (the non-fused path) is not run again, and the record equals the one
    without recompute."""
    from openk2.model import attention, attention_core
    from openk2.train.memory import MemorySection, apply_memory_options

    torch.manual_seed(0)
    model = K2ForCausalLM(small_config(initializer_range=0.2))
    ids = torch.randint(0, 97, (2, 13))
    plain = ForwardStats(model.config, track_max_logits=True)
    model(ids, labels=ids, stats=plain).loss.backward()
    records, probes = [], []
    record, probe = ForwardStats.record_max_logits, attention_core.head_max_logits
    monkeypatch.setattr(ForwardStats, "record_max_logits", lambda self, *a: records.append(1) or record(self, *a))
    monkeypatch.setattr(attention_core, "head_max_logits", lambda *a, **kw: probes.append(1) or probe(*a, **kw))

    def separate(q, k, v, scale, mask, need_max=True):  # the path a non-CPU device takes
        head_max = attention_core.head_max_logits(q, k, scale, mask) if need_max else None
        return attention_core.attend(q, k, v, scale, mask), head_max

    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(attention, "attend_with_max", separate)
        for mode in ("full", "selective"):
            records.clear(), probes.clear()
            handle = apply_memory_options(model, MemorySection(recompute=mode))
            try:
                stats = ForwardStats(model.config, track_max_logits=True)
                model(ids, labels=ids, stats=stats).loss.backward()
            finally:
                handle.remove()
            layers = model.config.num_hidden_layers
            # each layer records once into the call's collector, and the call's collector merges once
            assert len(records) == 2 * layers, (fused, mode)
            assert len(probes) == (0 if fused else layers), (fused, mode)
            torch.testing.assert_close(stats.max_logits(), plain.max_logits(), rtol=2**-20, atol=0)
