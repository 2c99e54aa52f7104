"""SFT conversations: exact assistant-only loss masks, file:line errors, packing that keeps conversations apart
(same logits as each conversation alone), and a resumable loader."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from openk2.chat.template import GENERATION_PROMPT, render
from openk2.config import ModelConfig
from openk2.data import toolchat
from openk2.data.conversations import (
    PAD_SEGMENT,
    ConversationLoader,
    conversation_pieces,
    pack_row,
    read_conversations,
    split_conversations,
    tokenize_conversations,
    tokenize_pieces,
)
from openk2.data.packing import IGNORE_INDEX
from openk2.data.tokenizer import train_tokenizer
from openk2.model import K2ForCausalLM

TOOL_CONVERSATION = {
    "messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Oslo and 3 * 4?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "b", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "3 * 4"}'}},
        ]},
        {"role": "tool", "tool_call_id": "a", "content": '{"temperature": 5}'},
        {"role": "tool", "tool_call_id": "b", "content": '{"result": 12}'},
        {"role": "assistant", "content": "5 degrees in Oslo; 3 * 4 = 12."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome!"},
    ],
    "tools": [toolchat.TOOLS["get_weather"], toolchat.TOOLS["calculate"]],
}


@pytest.fixture(scope="module")
def tokenizer():
    texts = [render(c["messages"], c.get("tools"), add_generation_prompt=False) for c in toolchat.generate(300, 9)]
    return train_tokenizer(texts, 640)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def test_loss_mask_covers_exactly_the_assistant_tokens(tokenizer):
    ids, mask = tokenize_pieces(conversation_pieces(TOOL_CONVERSATION), tokenizer)
    # Piece-wise tokens are the whole rendered text's tokens (every turn closed, as when the chat goes on).
    whole = render(TOOL_CONVERSATION["messages"], TOOL_CONVERSATION["tools"]).removesuffix(GENERATION_PROMPT)
    assert ids.tolist() == tokenizer.encode(whole, allow_special=True)
    im_end, section = tokenizer.special_ids["<|im_end|>"], tokenizer.special_ids["<|tool_calls_section_begin|>"]
    assert int((ids == im_end).sum()) == 1 + len(TOOL_CONVERSATION["messages"])  # tool_declare + each message
    runs = [tokenizer.decode(ids[a:b].tolist()) for a, b in _runs(mask)]
    assert runs == [
        'Checking.<|tool_calls_section_begin|><|tool_call_begin|>a<|tool_call_argument_begin|>'
        '{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>b<|tool_call_argument_begin|>'
        '{"expression": "3 * 4"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "5 degrees in Oslo; 3 * 4 = 12.<|im_end|>",
        "You're welcome!<|im_end|>",
    ]
    for a, b in _runs(mask):
        assert ids[a - 1] == tokenizer.special_ids["<|im_middle|>"]  # the header before it is context
        assert ids[b - 1] == im_end
    assert int((ids[mask] == section).sum()) == 1  # a special token is its single id, and it is trained on


def test_special_token_text_in_content_is_its_single_id(tokenizer):
    ids, mask = tokenize_pieces(conversation_pieces(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}), tokenizer)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    header = tokenizer.encode("<|im_assistant|>assistant<|im_middle|>", allow_special=True)
    assert len(header) == 3 and header[0] == tokenizer.special_ids["<|im_assistant|>"]
    assert tokenizer.decode(ids[mask].tolist()) == "ok<|im_end|>"


def test_read_errors_name_the_file_and_line(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    cases = {
        "{not json": "not valid JSON",
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}): "unknown role",
        json.dumps({"messages": [{"role": "user", "content": "x"}]}): "no assistant turn",
        json.dumps({"messages": [], "tools": []}): "non-empty list",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "extra": 1}): "unknown conversation key",
    }
    for bad, message in cases.items():
        path = tmp_path / "c.jsonl"
        path.write_text(good + "\n\n" + bad + "\n")
        with pytest.raises(ValueError, match=rf"c\.jsonl:3: .*{message}"):
            read_conversations(path)
    path.write_text(good + "\n")
    assert len(read_conversations(path)) == 1
    with pytest.raises(ValueError, match="not found"):
        read_conversations(tmp_path / "missing.jsonl")


def test_overlong_conversations_are_truncated_or_skipped_and_counted(tokenizer):
    conversations = toolchat.generate(40, seed=1)
    lengths = [len(tokenize_pieces(conversation_pieces(c), tokenizer)[0]) for c in conversations]
    limit = int(np.median(lengths))
    over = sum(n > limit for n in lengths)
    cut = tokenize_conversations(conversations, tokenizer, limit, "truncate")
    assert cut.truncated + cut.skipped == over and len(cut) == 40 - cut.skipped
    assert cut.lengths().max() <= limit
    skipped = tokenize_conversations(conversations, tokenizer, limit, "skip")
    assert skipped.skipped == over and skipped.truncated == 0 and len(skipped) == 40 - over
    with pytest.raises(ValueError, match="overlong"):
        tokenize_conversations(conversations, tokenizer, limit, "drop")


def test_pack_row_labels_positions_and_segments():
    a = (np.array([5, 6, 7]), np.array([False, True, True]))
    b = (np.array([8, 9]), np.array([False, True]))
    row = pack_row([a, b], seq_len=7, pad_id=0)
    assert row["input_ids"].tolist() == [5, 6, 7, 8, 9, 0, 0]
    assert row["labels"].tolist() == [IGNORE_INDEX, 6, 7, IGNORE_INDEX, 9, IGNORE_INDEX, IGNORE_INDEX]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert row["segment_ids"].tolist() == [0, 0, 0, 1, 1, PAD_SEGMENT, PAD_SEGMENT]
    with pytest.raises(ValueError, match="do not fit"):
        pack_row([a, b], seq_len=4, pad_id=0)


def _micro_model() -> K2ForCausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(
        vocab_size=640, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, n_routed_experts=8)
    return K2ForCausalLM(cfg).eval()


@torch.no_grad()
def test_packed_row_gives_each_conversation_its_own_logits(tokenizer):
    data = tokenize_conversations(toolchat.generate(3, seed=2), tokenizer, seq_len=512)
    loader = ConversationLoader(data, batch_size=1, seq_len=int(data.lengths().sum()) + 5, pad_id=tokenizer.pad_id,
                                shuffle=False)
    batch = next(loader)
    assert batch["segment_ids"][0].max() == 2  # all three in one row
    model = _micro_model()
    packed = model(batch["input_ids"], position_ids=batch["position_ids"], segment_ids=batch["segment_ids"]).logits
    unmasked = model(batch["input_ids"]).logits
    for k in range(3):
        ids, _ = data.conversation(k)
        where = (batch["segment_ids"][0] == k).nonzero().squeeze(1)
        alone = model(torch.from_numpy(ids)[None]).logits[0]
        torch.testing.assert_close(packed[0, where], alone, rtol=1e-4, atol=1e-4)
        if k > 0:  # without segment ids the later conversations would see the earlier ones
            assert not torch.allclose(unmasked[0, where], alone, atol=1e-3)
    # One segment with default positions is the plain causal forward.
    ids = batch["input_ids"][:, :50]
    one = model(ids, position_ids=torch.arange(50)[None], segment_ids=torch.zeros_like(ids)).logits
    torch.testing.assert_close(one, model(ids).logits)


def test_loader_resumes_mid_stream_and_val_pass_ends(tokenizer):
    data = tokenize_conversations(toolchat.generate(30, seed=4), tokenizer, seq_len=400)
    loader = ConversationLoader(data, batch_size=2, seq_len=400, pad_id=tokenizer.pad_id, seed=7)
    for _ in range(5):
        next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [next(loader) for _ in range(30)]  # crosses epoch boundaries
    resumed = ConversationLoader(data, batch_size=2, seq_len=400, pad_id=tokenizer.pad_id, seed=7)
    resumed.load_state_dict(state)
    for want in expected:
        got = next(resumed)
        assert all(torch.equal(got[k], want[k]) for k in want)
    other = tokenize_conversations(toolchat.generate(30, seed=5), tokenizer, seq_len=400)
    with pytest.raises(ValueError, match="different conversations"):
        ConversationLoader(other, 2, 400, tokenizer.pad_id, seed=7).load_state_dict(state)

    one_pass = ConversationLoader(data, batch_size=4, seq_len=400, pad_id=tokenizer.pad_id, shuffle=False, loop=False)
    seen = [int(s) for b in one_pass for row in b["segment_ids"] for s in [row.max() + 1]]
    assert sum(seen) == len(data)  # every conversation exactly once, then StopIteration


def test_split_is_seeded_and_disjoint():
    conversations = toolchat.generate(50, seed=0)
    train, val = split_conversations(conversations, 0.1, seed=3)
    assert len(val) == 5 and len(train) == 45
    assert split_conversations(conversations, 0.1, seed=3) == (train, val)
    assert all(v not in train for v in val)
    with pytest.raises(ValueError, match="val_fraction"):
        split_conversations(conversations, 1.0)
