"""The inference engine: latent-cache decode against the uncached forward, absorbed vs expanded MLA, sampling
controls (seeds, top-k/top-p, stops, n), continuous batching and the cache's size."""

from __future__ import annotations

import pytest
import torch

from openk2 import K2ForCausalLM, ModelConfig
from openk2.data.tokenizer import train_tokenizer
from openk2.infer.engine import Engine, PagedLatentCache, SamplingParams, absorbed_attention, expanded_attention
from openk2.infer.sampling import filter_top_k_top_p
from openk2.model import ForwardStats

from ..model.conftest import randomise_extras, small_config

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def make_model(cfg: ModelConfig | None = None, seed: int = 0) -> K2ForCausalLM:
    # initializer_range 0.1 (not 0.02) so attention is far from uniform and logits are O(1).
    torch.manual_seed(seed)
    model = K2ForCausalLM(cfg or small_config(initializer_range=0.1))
    randomise_extras(model, seed)
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # These models are tiny: on a shared 2-core machine a second intra-op thread only adds contention.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model(one_thread) -> K2ForCausalLM:
    return make_model()


def prompts_of(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def full_forward(model, prompt, generated):
    """Logits [len(generated), V] that the uncached model gives at the positions predicting `generated`."""
    ids = torch.tensor([prompt + generated[:-1]])
    return model(ids).logits[0, len(prompt) - 1:].float()


def assert_matches_full_forward(model, result, atol=1e-4):
    ref = full_forward(model, result.prompt_token_ids, result.token_ids)
    assert result.logits.shape == ref.shape
    torch.testing.assert_close(result.logits, ref, atol=atol, rtol=0)
    ref_logprobs = ref.log_softmax(-1).gather(1, torch.tensor(result.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(result.logprobs), ref_logprobs, atol=atol, rtol=0)


# ---------------------------------------------------------------------- cached decode == uncached forward
def test_greedy_decode_matches_full_forward_ragged_batch(model):
    """Prompts of different lengths, fewer slots than prompts, a prefill budget that splits the first admission
    and different max_tokens: a slot frees early, a waiting prompt is prefilled into it mid-flight and decodes next
    to non-contiguous slots."""
    prompts = prompts_of([5, 2, 9, 13], model.config.vocab_size)
    lengths = [12, 4, 9, 12]
    params = [SamplingParams(temperature=0, max_tokens=n, return_logits=True) for n in lengths]
    engine = Engine(model, max_batch_size=3, max_seq_len=32, max_prefill_tokens=16)
    results = engine.generate(prompts, params)
    assert [r.request_id for r in results] == [0, 1, 2, 3]
    for prompt, n, r in zip(prompts, lengths, results, strict=True):
        assert r.prompt_token_ids == prompt
        assert len(r.token_ids) == n and r.finish_reason == "length"
        assert_matches_full_forward(model, r)
        assert r.logits.argmax(-1).tolist() == r.token_ids
    assert not engine.has_unfinished()
    assert all(r == 0 for r in engine.cache.refs)  # every block released


def test_tiny_preset_matches_full_forward():
    cfg = ModelConfig.preset("tiny")
    model = make_model(cfg)
    prompts = prompts_of([7, 3], cfg.vocab_size)
    results = Engine(model, max_batch_size=2, max_seq_len=16).generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, return_logits=True))
    for r in results:
        assert_matches_full_forward(model, r)


def test_batching_does_not_change_results(model):
    prompts = prompts_of([3, 11, 6], model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=6, return_logits=True)
    batched = Engine(model, max_batch_size=4, max_seq_len=24).generate(prompts, params)
    for prompt, r in zip(prompts, batched, strict=True):
        alone = Engine(model, max_batch_size=1, max_seq_len=24).generate([prompt], params)[0]
        assert alone.token_ids == r.token_ids
        torch.testing.assert_close(alone.logits, r.logits, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- absorbed == expanded
@pytest.mark.parametrize("t", [1, 3])
def test_absorbed_attention_equals_expanded(model, t):
    attn = model.model.layers[1].self_attn
    b, s, h = 3, 10, attn.num_heads
    g = torch.Generator().manual_seed(0)
    q_nope = torch.randn(b, h, t, attn.nope_dim, generator=g)
    q_rope = torch.randn(b, h, t, attn.rope_dim, generator=g)
    kv = torch.randn(b, s, attn.kv_lora_rank + attn.rope_dim, generator=g)
    totals = torch.tensor([10, 4, 7])
    positions = totals[:, None] - t + torch.arange(t)
    keys = torch.arange(s)
    mask = ((keys <= positions[..., None]) & (keys < totals[:, None, None]))[:, None]
    with torch.no_grad():
        absorbed = absorbed_attention(attn, q_nope, q_rope, kv, mask)
        expanded = expanded_attention(attn, q_nope, q_rope, kv, mask)
    assert absorbed.shape == (b, t, h * attn.v_dim)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)
    # mask None: causal with the queries at the last t positions (t == s: SDPA's causal kernel)
    for s_len in (s, t):
        end_aligned = torch.ones(t, s_len, dtype=torch.bool).tril(s_len - t)
        with torch.no_grad():
            ref = expanded_attention(attn, q_nope, q_rope, kv[:, :s_len], end_aligned.expand(b, 1, t, s_len))
            torch.testing.assert_close(absorbed_attention(attn, q_nope, q_rope, kv[:, :s_len]), ref,
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(expanded_attention(attn, q_nope, q_rope, kv[:, :s_len]), ref,
                                       atol=1e-5, rtol=1e-5)
    # Changing cache rows a row may not see changes nothing.
    kv2 = kv.clone()
    kv2[1, 4:] = 1e3
    with torch.no_grad():
        torch.testing.assert_close(absorbed_attention(attn, q_nope, q_rope, kv2, mask), absorbed)


def test_engine_absorbed_decode_equals_expanded_decode(model):
    prompts = prompts_of([4, 8], model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=6, return_logits=True)
    absorbed = Engine(model, max_batch_size=2, max_seq_len=16).generate(prompts, params)
    expanded = Engine(model, max_batch_size=2, max_seq_len=16, absorbed=False).generate(prompts, params)
    for a, e in zip(absorbed, expanded, strict=True):
        assert a.token_ids == e.token_ids
        torch.testing.assert_close(a.logits, e.logits, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- sampling
def test_seeded_sampling_is_reproducible_and_batch_independent(model):
    prompts = prompts_of([4, 6], model.config.vocab_size)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234)
    engine = Engine(model, max_batch_size=4, max_seq_len=24)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    alone = Engine(model, max_batch_size=1, max_seq_len=24).generate(prompts[1:], params)[0]
    assert alone.token_ids == first[1].token_ids
    other = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=10, seed=99))
    assert [r.token_ids for r in other] != [r.token_ids for r in first]


def test_sampled_logprobs_are_unfiltered_temperature_one(model):
    prompt = prompts_of([5], model.config.vocab_size)[0]
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.8, max_tokens=8, seed=3, return_logits=True)
    r = Engine(model, max_batch_size=1, max_seq_len=16).generate([prompt], params)[0]
    assert_matches_full_forward(model, r)
    # every sampled token lies in its step's top-5
    top5 = r.logits.topk(5, dim=-1).indices
    assert all(tok in row for tok, row in zip(r.token_ids, top5.tolist(), strict=True))


def test_top_k_one_and_tiny_top_p_equal_greedy(model):
    prompts = prompts_of([3, 7], model.config.vocab_size)
    engine = Engine(model, max_batch_size=2, max_seq_len=24)
    greedy = [r.token_ids for r in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10))]
    top1 = engine.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, seed=5))
    tiny_p = engine.generate(prompts, SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=10, seed=5))
    assert [r.token_ids for r in top1] == greedy
    assert [r.token_ids for r in tiny_p] == greedy


def test_filter_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    kept = filter_top_k_top_p(logits, torch.tensor([0, 2]), torch.tensor([0.7, 1.0])).isfinite()
    assert kept.tolist() == [[True, True, False, False], [False, False, True, True]]
    kept = filter_top_k_top_p(logits, torch.tensor([3, 0]), torch.tensor([0.9, 0.5])).isfinite()
    assert kept.tolist() == [[True, True, True, False], [False, False, False, True]]


def test_n_samples_per_prompt_share_the_prefill(model):
    prompts = prompts_of([5, 3], model.config.vocab_size)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=11, return_logits=True)
    results = Engine(model, max_batch_size=4, max_seq_len=16).generate(prompts, params)
    assert [(r.request_id, r.sample_index) for r in results] == [(p, i) for p in range(2) for i in range(3)]
    for r in results:
        assert r.prompt_token_ids == prompts[r.request_id]
        assert_matches_full_forward(model, r)  # siblings' copied caches are right
    samples = [tuple(r.token_ids) for r in results[:3]]
    assert len(set(samples)) > 1
    torch.testing.assert_close(results[0].logits[0], results[2].logits[0])
    # fewer slots than samples: siblings run in later waves, same seeded samples
    narrow = Engine(model, max_batch_size=2, max_seq_len=16).generate(prompts, params)
    assert [r.token_ids for r in narrow] == [r.token_ids for r in results]


# ---------------------------------------------------------------------- stopping
def test_stop_token_and_length(model):
    prompt = prompts_of([6], model.config.vocab_size)[0]
    engine = Engine(model, max_batch_size=1, max_seq_len=32)
    ref = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 10 and ref.stop_reason is None
    stop_tok = ref.token_ids[3]
    cut = ref.token_ids.index(stop_tok) + 1
    r = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]))[0]
    assert r.finish_reason == "stop" and r.stop_reason == stop_tok
    assert r.token_ids == ref.token_ids[:cut] and len(r.logprobs) == cut
    # the config's eos stops too, unless ignore_eos
    eos_model = make_model(small_config(initializer_range=0.1, eos_token_id=stop_tok))
    eos_engine = Engine(eos_model, max_batch_size=1, max_seq_len=32)
    assert eos_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0].token_ids == r.token_ids
    kept = eos_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert kept.token_ids == ref.token_ids and kept.finish_reason == "length"


def test_stop_strings_with_tokenizer():
    texts = ["the quick brown fox jumps over the lazy dog. " * 3, "pack my box with five dozen liquor jugs 0123"]
    tok = train_tokenizer(texts, vocab_size=600)
    model = make_model(small_config(initializer_range=0.1, vocab_size=tok.vocab_size))
    engine = Engine(model, tokenizer=tok, max_batch_size=2, max_seq_len=40)
    prompt = tok.encode("the quick brown")
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert free.text == tok.decode(free.token_ids)
    stop = free.text[len(free.text) // 2:][:3]
    assert stop
    cut = next(k for k in range(1, 17) if stop in tok.decode(free.token_ids[:k]))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop, "\x00never"])
    r = engine.generate([prompt], params)[0]
    assert r.finish_reason == "stop" and r.stop_reason == stop
    assert r.token_ids == free.token_ids[:cut]
    full_text = tok.decode(r.token_ids)
    assert r.text == full_text[: full_text.index(stop)]
    with pytest.raises(ValueError, match="tokenizer"):
        Engine(model, max_batch_size=1, max_seq_len=40).add_request(prompt, params)


# ---------------------------------------------------------------------- incremental API and bookkeeping
def test_step_api_add_request_mid_flight_and_abort(model):
    prompts = prompts_of([4, 6, 5], model.config.vocab_size)
    engine = Engine(model, max_batch_size=2, max_seq_len=24)
    params = SamplingParams(temperature=0, max_tokens=5, return_logits=True)
    a = engine.add_request(prompts[0], params)
    doomed = engine.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=15))
    assert engine.step() == []  # prefill: the first token of each
    assert [len(s.tokens) for s in engine._running] == [1, 1]
    assert engine.step() == []  # one decode step: one more token each
    c = engine.add_request(prompts[2], params, request_id="late")
    engine.abort(doomed)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert sorted(str(r.request_id) for r in done) == sorted(map(str, [a, c]))
    for r in done:
        assert_matches_full_forward(model, r)


def test_engine_leaves_model_state_alone(model):
    model.train()
    stats = ForwardStats(model.config, track_max_logits=True)  # a trainer's step record, mid-step
    with torch.no_grad():
        model(torch.tensor([[4, 5, 6, 7]]), stats=stats)
    counts, max_logits = stats.tokens_per_expert(), stats.max_logits()
    Engine(model, max_batch_size=1, max_seq_len=16).generate([[1, 2, 3]], GREEDY)
    assert model.training and bool((stats.tokens_per_expert() == counts).all())
    assert torch.equal(stats.max_logits(), max_logits)
    model.eval()


def test_engine_runs_the_models_own_layers_with_its_cache_attention_and_no_collector(model):
    seen = []

    def record(layer, args, kwargs):
        seen.append((layer.layer_idx, kwargs.get("stats"), type(kwargs.get("inner_attention")).__name__))

    hooks = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in model.model.layers]
    params = SamplingParams(temperature=0, max_tokens=3)
    try:
        Engine(model, max_batch_size=1, max_seq_len=16).generate([[1, 2, 3]], params)
    finally:
        for h in hooks:
            h.remove()
    layers = model.config.num_hidden_layers
    assert len(seen) == 3 * layers  # one prefill, two decode steps
    assert [i for i, _, _ in seen] == list(range(layers)) * 3
    assert all(stats is None and inner == "LatentCacheAttention" for _, stats, inner in seen)


def test_request_validation(model):
    engine = Engine(model, max_batch_size=1, max_seq_len=10)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add_request([1] * 5, SamplingParams(max_tokens=6))
    with pytest.raises(ValueError, match="at least one"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([model.config.vocab_size], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    engine.add_request([1, 2], GREEDY, request_id=0)
    with pytest.raises(ValueError, match="in use"):
        engine.add_request([3], GREEDY, request_id=0)
    assert engine.add_request([3], GREEDY) == 1  # automatic ids skip ids in use


def test_cache_holds_latent_and_rope_key_only():
    cfg = ModelConfig.preset("tiny")
    cache = PagedLatentCache(cfg, num_blocks=2, block_size=8)
    assert cache.kv.shape == (cfg.num_hidden_layers, 2 * 8, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert cache.bytes_per_token == cfg.num_hidden_layers * (64 + 16) * 4
    per_head = cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * 4
    assert per_head / cache.bytes_per_token == pytest.approx(4.0)
