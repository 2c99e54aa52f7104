"""The paged latent cache: prefix reuse across requests (shared prompts, multi-turn, n > 1), chunked prefill,
admission by free blocks, LRU reclaim, and invalidation when the weights change -- every result checked against
the plain model forward."""

from __future__ import annotations

import pytest
import torch

from openk2.infer.engine import Engine, SamplingParams
from openk2.infer.kv_cache import PagedLatentCache, prefix_hashes

from .test_engine import assert_matches_full_forward, make_model, prompts_of

BS = 8  # block size used throughout: small, so prompts span several blocks


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return make_model()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, return_logits=True, **kw)


def run(engine: Engine, prompt, params) -> tuple:
    before = engine.prefill_tokens_computed
    r = engine.generate([prompt], params)
    return r, engine.prefill_tokens_computed - before


def test_shared_prefix_is_computed_once_and_stays_exact(model):
    vocab = model.config.vocab_size
    shared, tail_a, tail_b = prompts_of([35, 4, 6], vocab)
    engine = Engine(model, max_batch_size=2, max_seq_len=64, block_size=BS)
    (a,), computed_a = run(engine, shared + tail_a, greedy(5))
    assert computed_a == 39
    (b,), computed_b = run(engine, shared + tail_b, greedy(5))
    # 35 shared tokens = 4 full blocks of 8 (32 tokens) reused; the other 3 + 6 are computed.
    assert computed_b == 41 - 32 and engine.cache.hits == 4
    for r in (a, b):
        assert_matches_full_forward(model, r)
    # The same prompt again: all but the last block are hits (the last token must run to give logits).
    (c,), computed_c = run(engine, shared + tail_b, greedy(5))
    assert computed_c == 41 - 40 and c.token_ids == b.token_ids
    assert_matches_full_forward(model, c)


def test_multi_turn_reuses_the_generated_tokens_too(model):
    vocab = model.config.vocab_size
    first, user2 = prompts_of([13, 5], vocab)
    engine = Engine(model, max_batch_size=1, max_seq_len=64, block_size=BS)
    (turn1,), _ = run(engine, first, greedy(12, ignore_eos=True))
    history = first + turn1.token_ids  # 25 tokens: the last one was sampled, never cached
    (turn2,), computed = run(engine, history + user2, greedy(4))
    assert computed == len(history) + len(user2) - 24  # 3 full blocks, 11 generated tokens among them
    assert_matches_full_forward(model, turn2)


def test_n_samples_share_the_prompt_blocks(model):
    prompt = prompts_of([20], model.config.vocab_size)[0]
    engine = Engine(model, max_batch_size=4, max_seq_len=40, block_size=BS)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=7, return_logits=True)
    engine.add_request(prompt, params)
    engine.step()  # one prefill for all three: 2 full blocks shared, the partial one copied per sibling
    assert engine.prefill_tokens_computed == 20
    tables = [s.blocks for s in engine._running]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    assert [engine.cache.refs[b] for b in tables[0][:2]] == [3, 3]
    results = []
    while engine.has_unfinished():
        results += engine.step()
    for r in results:
        assert_matches_full_forward(model, r)
    assert all(r == 0 for r in engine.cache.refs)


def test_chunked_prefill_keeps_decoding_and_stays_exact(model):
    short, long = prompts_of([3, 30], model.config.vocab_size)
    engine = Engine(model, max_batch_size=2, max_seq_len=48, max_prefill_tokens=8, block_size=BS)
    engine.add_request(short, greedy(8), request_id="short")
    engine.step()
    engine.add_request(long, greedy(4), request_id="long")
    progress = []
    done = []
    while engine.has_unfinished():
        done += engine.step()
        progress.append({rid: len(toks) for rid, _, toks, _ in engine.running_progress()})
    # 30 prompt tokens in chunks of 8: the long prompt's first token comes on the 4th step, and the short one
    # gained a token on each of those steps.
    assert [p.get("long", 0) for p in progress[:4]] == [0, 0, 0, 1]
    assert [p["short"] for p in progress[:4]] == [2, 3, 4, 5]
    for r in done:
        assert_matches_full_forward(model, r)


def test_admission_waits_for_free_blocks(model):
    prompts = prompts_of([9, 12, 7, 15], model.config.vocab_size)
    # 6 blocks of 8: each request needs up to 3 (prompt + 8 new tokens), so at most two run at a time.
    engine = Engine(model, max_batch_size=4, max_seq_len=24, block_size=BS, num_blocks=6, prefix_caching=False,
                    preemption=False)
    for p in prompts:
        engine.add_request(p, greedy(8, ignore_eos=True))
    engine.step()
    assert len(engine._running) == 2 and len(engine._waiting) == 2
    results = []
    while engine.has_unfinished():
        results += engine.step()
        assert engine.cache.num_available >= 0
    assert len(results) == 4
    for r in results:
        assert_matches_full_forward(model, r)
    with pytest.raises(ValueError, match="num_blocks"):
        Engine(model, max_seq_len=64, block_size=BS, num_blocks=3)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_recomputes_and_stays_exact(model, prefix_caching):
    """Admitted on their prompt alone, four sequences outgrow a 6-block cache: the latest admitted are preempted,
    requeued at the head and recomputed (prompt + tokens so far); every result still equals the plain forward,
    sampled ones included (each keeps its generator), and every block comes back."""
    prompts = prompts_of([9, 12, 7, 15], model.config.vocab_size)
    params = [greedy(9, ignore_eos=True), SamplingParams(temperature=1.0, seed=5, max_tokens=9, ignore_eos=True,
                                                         return_logits=True)] * 2
    engine = Engine(model, max_batch_size=4, max_seq_len=24, block_size=BS, num_blocks=6,
                    prefix_caching=prefix_caching, record_routing=True)
    for p, sp in zip(prompts, params, strict=True):
        engine.add_request(p, sp)
    engine.step()
    assert len(engine._running) == 3  # prompt + first token: 2 + 2 + 1 blocks; the fourth (2) waits
    results = []
    while engine.has_unfinished():
        results += engine.step()
        assert sum(len(s.blocks) for s in engine._running) <= 6
    assert engine.preemptions >= 1
    if not prefix_caching:  # a victim recomputes its prompt and the tokens it had generated
        assert engine.prefill_tokens_computed > sum(map(len, prompts))
    assert sorted(len(r.token_ids) for r in results) == [9] * 4
    for r in results:
        assert_matches_full_forward(model, r)
    # The sampled ones drew what an engine with room for all of them draws.
    roomy = Engine(model, max_batch_size=4, max_seq_len=24, block_size=BS, record_routing=True)
    reference = roomy.generate(prompts, params)
    results.sort(key=lambda r: r.request_id)
    assert [r.token_ids for r in reference] == [r.token_ids for r in results]
    assert roomy.preemptions == 0
    # Routing (R3) keeps the experts that produced each token, recorded once per position, never the recompute's.
    for r, ref in zip(results, reference, strict=True):
        assert r.routing.shape == (len(r.prompt_token_ids) + len(r.token_ids) - 1, *ref.routing.shape[1:])
        if not prefix_caching:
            assert torch.equal(r.routing, ref.routing)
    assert all(ref == 0 for ref in engine.cache.refs)


def test_idle_cached_blocks_are_reclaimed_least_recently_used_first(model):
    cfg = model.config
    cache = PagedLatentCache(cfg, num_blocks=3, block_size=4)
    a, b = cache.allocate(), cache.allocate()
    names = prefix_hashes(list(range(8)), 4)
    cache.register(a, names[0])
    cache.register(b, names[1])
    cache.release([a, b])  # both idle, still named
    assert cache.num_available == 3
    assert cache.match(names) == [a, b]
    cache.release([b, a])  # b is now the least recently used idle block
    assert cache.allocate() not in (a, b)  # the free block first
    assert cache.allocate() == b  # then the LRU idle block, whose name is dropped
    assert cache.match(names) == [a]  # the chain now stops after the first block
    assert prefix_hashes([1, 2, 3, 4], 4) != prefix_hashes([1, 2, 3, 5], 4)


def test_changed_weights_invalidate_cached_prefixes(model):
    prompt = prompts_of([26], model.config.vocab_size)[0]
    changed = make_model(seed=0)
    engine = Engine(changed, max_batch_size=1, max_seq_len=40, block_size=BS)
    run(engine, prompt, greedy(3))
    with torch.no_grad():
        changed.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.mul_(1.5)  # an in-place update (RL sync)
    (r,), computed = run(engine, prompt, greedy(3))
    assert computed == 26  # nothing reused
    assert_matches_full_forward(changed, r)
