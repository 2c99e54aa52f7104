"""The engine's one-token decode step (infer/decode_step.py) against the model's own modules: bit-identical logits,
tokens and routing, and the module path whenever the model is wrapped or hooked."""

from __future__ import annotations

import pytest
import torch

from openk2.infer import decode_step
from openk2.infer.engine import Engine, SamplingParams
from openk2.model.layers import RMSNorm
from openk2.model.rope import apply_rope

from ..model.conftest import small_config
from .test_engine import make_model, prompts_of

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, return_logits=True)



def both(model, prompts, params=PARAMS, **kw):
    fast = Engine(model, max_batch_size=4, max_seq_len=64, **kw)
    plain = Engine(model, max_batch_size=4, max_seq_len=64, fast_decode=False, **kw)
    assert fast.fast_decode and not plain.fast_decode
    return fast.generate(prompts, params), plain.generate(prompts, params)


@pytest.mark.parametrize("interleave", [False, True])
def test_rope_matches_apply_rope_bit_for_bit(interleave):
    g = torch.Generator().manual_seed(0)
    x_BXR = torch.randn(3, 5, 8, generator=g)
    cos, sin = torch.randn(3, 1, 4, generator=g), torch.randn(3, 1, 4, generator=g)
    ref = apply_rope(x_BXR[:, :, None], cos, sin, interleave)[:, :, 0]
    got = decode_step._rope(x_BXR, torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1), interleave)
    assert torch.equal(got, ref)


def test_fused_rms_norm_matches_the_module_bit_for_bit():
    # K2's norm widths (hidden 7168, q LoRA 1536, kv LoRA 512) and the test configs' odd small ones.
    g = torch.Generator().manual_seed(0)
    for d in (16, 24, 100, 512, 1536, 7168):
        norm = RMSNorm(d)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(d, generator=g))
            x = 3 * torch.randn(9, d, generator=g)
            assert torch.equal(decode_step.rms(x, norm), norm(x)), d


@pytest.mark.parametrize("overrides", [{}, {"rope_interleave": False, "attention_bias": True},
                                       {"q_lora_rank": None, "n_group": 2, "topk_group": 1}])
def test_fast_decode_is_bit_identical_to_the_module_path(overrides):
    # Prompts of different lengths: the decode steps then carry a key mask (rows end at different positions).
    model = make_model(small_config(initializer_range=0.1, **overrides))
    fast, plain = both(model, prompts_of([5, 11, 3, 8], model.config.vocab_size))
    for a, b in zip(fast, plain, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.logits, b.logits)
        assert a.logprobs == b.logprobs


def test_fast_decode_records_the_same_routing():
    model = make_model()
    fast, plain = both(model, prompts_of([4, 9], model.config.vocab_size), record_routing=True)
    for a, b in zip(fast, plain, strict=True):
        assert torch.equal(a.routing, b.routing)


def test_fast_decode_bf16_matches_the_module_path():
    model = make_model().to(torch.bfloat16)
    fast, plain = both(model, prompts_of([6, 2], model.config.vocab_size))
    for a, b in zip(fast, plain, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.logits, b.logits)


def test_hooked_or_wrapped_models_take_the_module_path(monkeypatch):
    model = make_model()
    calls = []
    monkeypatch.setattr(decode_step, "decode_hidden", lambda *a, **k: calls.append(1) / 0)
    seen = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: seen.append(1))
    try:
        engine = Engine(model, max_batch_size=2, max_seq_len=32)
        engine.generate(prompts_of([4], model.config.vocab_size), PARAMS)  # a hook added before construction
    finally:
        handle.remove()
    assert not engine.fast_decode and seen and not calls
    engine = Engine(model, max_batch_size=2, max_seq_len=32)
    assert engine.fast_decode
    seen.clear()
    handle = model.model.layers[2].self_attn.register_forward_hook(lambda *a: seen.append(1))
    try:
        engine.generate(prompts_of([4], model.config.vocab_size), PARAMS)  # a hook added after construction
    finally:
        handle.remove()
    assert len(seen) == PARAMS.max_tokens and not calls  # the prefill and every decode step ran the hooked module
    layer = model.model.layers[0]
    monkeypatch.setattr(layer, "forward", layer.forward)  # a wrapper installed after construction
    engine.generate(prompts_of([4], model.config.vocab_size), PARAMS)
    assert not calls
    assert not decode_step.supports(model)


def test_the_layout_check_is_cached_until_something_changes(monkeypatch):
    model = make_model()
    engine = Engine(model, max_batch_size=2, max_seq_len=32)
    checks = []
    supports = decode_step.supports
    monkeypatch.setattr(decode_step, "supports", lambda m: checks.append(1) or supports(m))
    prompt = prompts_of([4], model.config.vocab_size)
    engine.generate(prompt, PARAMS)
    assert len(checks) == 1  # the first decode step; the later ones reuse its answer
    handle = model.model.layers[1].mlp.register_forward_pre_hook(lambda *a: None)
    handle.remove()  # registered and removed: the counter moved, so the tree is walked again (and still plain)
    engine.generate(prompt, PARAMS)
    assert len(checks) == 2 and engine._decode_step_applies()
    calls = []
    monkeypatch.setattr(decode_step, "decode_hidden", lambda *a, **k: calls.append(1) / 0)
    seen = []

    class Counting(torch.nn.Module):  # a swapped submodule (no hook registered): the module path must run it
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            seen.append(1)
            return self.inner(x)

    monkeypatch.setattr(model.model.layers[2], "mlp", Counting(model.model.layers[2].mlp))
    engine.generate(prompt, PARAMS)
    assert len(seen) == PARAMS.max_tokens and not calls
