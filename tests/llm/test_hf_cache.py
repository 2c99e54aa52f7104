"""`growing_cache` (openk2.llm.hf_cache): in-place KV appends decode exactly what transformers' DynamicCache does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from openk2.llm.hf_cache import GrowingLayer, growing_cache  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_greedy_generate_equals_the_dynamic_cache(llama):
    """Left-padded batch, more new tokens than the reserve (so the buffer grows twice): same tokens, same scores."""
    ids = torch.randint(1, 64, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    kw = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 40, "do_sample": False, "pad_token_id": 0,
          "eos_token_id": None, "output_scores": True, "return_dict_in_generate": True}
    with torch.no_grad():
        plain = llama.generate(**kw, cache=transformers.DynamicCache())
        grown = llama.generate(**kw, cache=growing_cache(reserve=8, num_layers=2))
    assert torch.equal(plain.sequences, grown.sequences)
    used = grown.past_key_values.layers[0]
    assert isinstance(used, GrowingLayer) and used._bufs is not None and used._bufs[0].shape[-2] > 9 + 8
    assert all(torch.equal(a, b) for a, b in zip(plain.scores, grown.scores, strict=True))


def test_appends_in_place_and_recovers_after_the_tensors_are_replaced():
    layer = GrowingLayer(reserve=4)
    k, v = torch.randn(2, 1, 3, 2), torch.randn(2, 1, 3, 2)
    layer.update(k, v)
    buffer = layer._bufs[0]
    step = torch.randn(2, 1, 1, 2)
    keys, _ = layer.update(step, step)
    assert layer._bufs[0] is buffer and torch.equal(keys, torch.cat([k, step], dim=-2))  # no copy: same buffer
    layer.batch_select_indices(torch.tensor([1]))  # replaces the tensors: the next append starts a new buffer
    keys, values = layer.update(step[:1], step[:1])
    assert keys.shape == (1, 1, 5, 2) and torch.equal(keys[0, :, :3], k[1])
    assert torch.equal(values[0, :, 4], step[0, :, 0])
    for _ in range(10):  # past the reserve: the buffer grows, the contents stay
        keys, _ = layer.update(step[:1], step[:1])
    assert keys.shape[-2] == 15 and torch.equal(keys[0, :, :3], k[1]) and layer.get_seq_length() == 15
