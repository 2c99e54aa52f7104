"""`PrefixKVStore` (openk2.llm.hf_kvstore): prompt heads' KV reused across `generate` calls of the hf backend."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from openk2.llm.hf_backend import HFChatModel  # noqa: E402
from openk2.llm.hf_kvstore import PrefixKVStore, kv_bytes  # noqa: E402
from tests.llm.test_hf_backend import TOOLS, tiny_dir  # noqa: E402, F401  (the tiny random Llama fixture)


def _kv(length: int, layers: int = 2) -> list:
    return [(torch.full((1, 2, length, 4), float(i)), torch.full((1, 2, length, 4), -float(i))) for i in range(layers)]


def test_longest_shared_head_and_lru_eviction_within_the_byte_budget():
    one = kv_bytes(_kv(10))
    store = PrefixKVStore(max_bytes=2 * one)
    assert store.put(list(range(10)), _kv(10)) and store.put([7] * 10, _kv(10))
    c, kv = store.longest([0, 1, 2, 3, 99], limit=4)  # shares 4 tokens, capped by the limit
    assert c == 4 and kv is not None
    assert store.longest([0, 1, 2, 3, 4, 5, 6], limit=5)[0] == 5
    assert store.longest([5, 5], limit=2) == (0, None)
    store.put([8] * 10, _kv(10))  # over budget: the least recently used entry ([7] * 10) goes
    assert store.keys() == [tuple(range(10)), (8,) * 10] and store.bytes <= store.max_bytes
    assert store.stats["evicted"] == 1 and store.stats["hits"] == 2 and store.stats["misses"] == 1
    assert not store.put([9] * 30, _kv(30)) and len(store) == 2  # larger than the whole budget: not stored
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixKVStore(-1)


def test_reused_heads_decode_exactly_what_recomputing_decodes(tiny_dir):  # noqa: F811
    """Greedy rows whose prompt heads come from earlier batches (whole heads, heads of a longer stored prompt,
    rows with no partner in their batch) decode what the backend decodes without the store."""
    head = {"role": "system", "content": "You help customers of a bike shop; be short and exact. " * 3}
    batches = [[[head, {"role": "user", "content": u}] for u in ("hi", "where is order 7?", "refund")],
               [[head, {"role": "user", "content": u}] for u in ("thanks!", "open today?")],
               [[head, {"role": "user", "content": "one more question"}]],  # alone: only the store can help
               [[{"role": "system", "content": head["content"][:90] + " Other text."},
                 {"role": "user", "content": "diverges inside the head"}], [{"role": "user", "content": "none"}]]]
    cached = HFChatModel(tiny_dir, prefix_cache_mb=64)
    plain = HFChatModel(tiny_dir, prefix_cache_mb=0)
    for extra in ({}, {"tools": TOOLS, "tool_choice": "required"}):
        sampling = {"temperature": 0.0, "max_tokens": 10, **{k: v for k, v in extra.items() if k != "tools"}}
        for convos in batches:
            got = [(model._generate([model._plan(c, extra.get("tools"), dict(sampling)) for c in convos]))
                   for model in (cached, plain)]
            texts = [[(r[0].content, [c["function"]["arguments"] for c in r[0].tool_calls]) for r in rs]
                     for rs in got]
            assert texts[0] == texts[1]
    assert cached.kv_store.stats["hits"] >= 4 and cached.kv_store.stats["hit_tokens"] > 300
    assert cached.prefix_stats["shared_tokens"] > plain.prefix_stats["shared_tokens"]
    assert 0 < cached.kv_store.bytes <= cached.kv_store.max_bytes


def test_the_store_stays_within_its_budget_under_many_heads(tiny_dir):  # noqa: F811
    """Many distinct heads through a small store: the bytes held never exceed the budget; old heads are evicted."""
    model = HFChatModel(tiny_dir, prefix_cache_mb=1)
    model.kv_store.max_bytes = 100_000  # two heads of the tiny model (256 bytes per token)
    peak = 0
    for k in range(6):
        head = {"role": "system", "content": f"Head number {k}: " + "words that fill a long system prompt. " * 4}
        convos = [[head, {"role": "user", "content": u}] for u in ("a", "b")]
        model._generate([model._plan(c, None, {"temperature": 0.0, "max_tokens": 2}) for c in convos])
        peak = max(peak, model.kv_store.bytes)
    assert peak <= 100_000 and model.kv_store.stats["evicted"] >= 3 and len(model.kv_store) >= 1


def test_a_long_rest_prefilled_alone_decodes_what_the_padded_batch_decodes(tiny_dir, monkeypatch):  # noqa: F811
    """Rows sharing a head plus one row with a long prompt of its own: the long row's excess is computed alone
    (`batched_rest_width`), and every row decodes what the plain left-padded batch decodes."""
    from openk2.llm import hf_prefix

    extended = []
    real = hf_prefix._extend

    def counting(model, tokens, c, kv, device):
        extended.append(len(tokens) - c)
        return real(model, tokens, c, kv, device)

    monkeypatch.setattr(hf_prefix, "_extend", counting)
    head = {"role": "system", "content": "You answer questions about trains; keep it short. " * 3}
    convos = [[head, {"role": "user", "content": u}] for u in ("next train?", "price?", "late?", "hi", "bye")]
    convos.append([{"role": "user", "content": "a long request of my own that shares nothing with the rest " * 3}])
    shared, plain = HFChatModel(tiny_dir, prefix_cache_mb=0), HFChatModel(tiny_dir, min_shared_prefix=0)
    sampling = {"temperature": 0.0, "max_tokens": 10}
    got = [m._generate([m._plan(c, None, dict(sampling)) for c in convos]) for m in (shared, plain)]
    assert [r[0].content for r in got[0]] == [r[0].content for r in got[1]]
    assert len(extended) == 2 and extended[1] > 100  # the head, then the long row's excess alone
