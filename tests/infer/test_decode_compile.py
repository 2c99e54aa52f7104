"""The compiled decode step (infer/compiled_decode.py): greedy tokens equal to the module path's, batch buckets with
padding rows (the static graph uncompiled; one real inductor compile, slow), the eager fallbacks (routing records,
hooks) and the option's errors."""

from __future__ import annotations

import time

import pytest
import torch

from openk2.infer import compiled_decode
from openk2.infer.engine import Engine, SamplingParams

from ..model.conftest import small_config
from .test_engine import make_model, prompts_of


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, return_logits=True)


def run(engine: Engine, prompts, lengths):
    for p, n in zip(prompts, lengths, strict=True):
        engine.add_request(p, params(n))
    out = []
    while engine.has_unfinished():
        out += engine.step()
    return sorted(out, key=lambda r: r.request_id)


def test_bucket_is_the_next_power_of_two():
    assert [compiled_decode.bucket(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    with pytest.raises(ValueError, match="at least one row"):
        compiled_decode.bucket(0)


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None, "n_group": 2, "topk_group": 1}])
def test_static_graph_matches_the_module_path(overrides):
    # The static graph run uncompiled ("none"). Unequal prompts (key masks) and max_tokens (the batch shrinks
    # 3 -> 2 -> 1: buckets 4, 2, 1 with padding rows writing the scratch block) exercise every padding case.
    model = make_model(small_config(initializer_range=0.1, **overrides))
    prompts, lengths = prompts_of([5, 11, 3], model.config.vocab_size), [7, 4, 2]
    compiled = Engine(model, max_batch_size=4, max_seq_len=64, decode_compile="none")
    plain = Engine(model, max_batch_size=4, max_seq_len=64, fast_decode=False)
    got, ref = run(compiled, prompts, lengths), run(plain, prompts, lengths)
    assert sorted(compiled.decode_compile_seconds) == [1, 2, 4]
    for a, b in zip(got, ref, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)
    assert compiled.cache.num_available == compiled.cache.num_blocks - 1  # all released but the scratch block


def test_routing_records_and_hooks_take_the_eager_paths(monkeypatch):
    model = make_model()
    calls = []
    monkeypatch.setattr(compiled_decode.CompiledDecode, "__call__", lambda *a, **k: calls.append(1) / 0)
    engine = Engine(model, max_batch_size=2, max_seq_len=32, decode_compile="eager", record_routing=True)
    plain = Engine(model, max_batch_size=2, max_seq_len=32, fast_decode=False, record_routing=True)
    prompts = prompts_of([4, 6], model.config.vocab_size)
    for a, b in zip(run(engine, prompts, [3, 3]), run(plain, prompts, [3, 3]), strict=True):
        assert torch.equal(a.routing, b.routing)
    engine = Engine(model, max_batch_size=2, max_seq_len=32, decode_compile="eager")
    seen = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: seen.append(1))
    try:
        run(engine, prompts[:1], [3])  # a hook added after construction: every step runs the hooked module
    finally:
        handle.remove()
    assert len(seen) == 3 and not calls


def test_decode_compile_errors():
    model = make_model()
    with pytest.raises(ValueError, match="exclusive"):
        Engine(model, max_batch_size=2, max_seq_len=32, compile=True, decode_compile=True)
    with pytest.raises(ValueError, match="needs fast_decode"):
        Engine(model, max_batch_size=2, max_seq_len=32, fast_decode=False, decode_compile=True)
    with pytest.raises(ValueError, match="float32 models only"):
        Engine(make_model().to(torch.bfloat16), max_batch_size=2, max_seq_len=32, decode_compile="none")


@pytest.mark.slow
def test_inductor_compiled_step_gives_the_module_path_tokens():
    # The real compile (inductor, C++ wrapper) of a 2-layer model at one bucket: about a minute on 2 shared cores.
    model = make_model(small_config(initializer_range=0.1, num_hidden_layers=2))
    prompts, lengths = prompts_of([5, 9], model.config.vocab_size), [6, 6]
    compiled = Engine(model, max_batch_size=2, max_seq_len=48, decode_compile=True)
    start = time.perf_counter()
    got = run(compiled, prompts, lengths)
    print(f"compile + generate {time.perf_counter() - start:.1f} s")
    ref = run(Engine(model, max_batch_size=2, max_seq_len=48, fast_decode=False), prompts, lengths)
    for a, b in zip(got, ref, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)
    with torch.no_grad():  # an in-place weight update (an RL sync): the compiled graph reads the new values
        model.lm_head.weight.mul_(-1)
    got, ref = run(compiled, prompts, lengths), run(Engine(model, max_batch_size=2, max_seq_len=48), prompts, lengths)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    other = Engine(model, max_batch_size=2, max_seq_len=96, decode_compile=True)  # another cache size: no recompile
    assert [r.token_ids for r in run(other, prompts, lengths)] == [r.token_ids for r in got]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
