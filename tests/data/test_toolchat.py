"""The tool-use conversation generator: valid, seeded, self-consistent, and held-out prompts that share no entity."""

from __future__ import annotations

import json

import pytest

from openk2.data import toolchat
from openk2.data.conversations import conversation_segments


def _calls(conversation: dict) -> list[dict]:
    return [c["function"] for m in conversation["messages"] if m["role"] == "assistant"
            for c in m.get("tool_calls", [])]


def test_generate_is_seeded_and_every_conversation_renders():
    first, again, other = toolchat.generate(200, seed=3), toolchat.generate(200, seed=3), toolchat.generate(200, 4)
    assert first == again
    assert first != other
    for conversation in first:
        segments = conversation_segments(conversation)  # raises on anything the template rejects
        assert any(is_assistant for _, is_assistant in segments)


def test_tool_calls_match_their_schema_and_the_answer_uses_the_result():
    conversations = toolchat.generate(300, seed=0)
    with_calls = [c for c in conversations if _calls(c)]
    assert 0.7 < len(with_calls) / len(conversations) < 0.9  # plain_fraction = 0.2
    for conversation in with_calls:
        (call,) = _calls(conversation)
        declared = {t["function"]["name"]: t["function"] for t in conversation["tools"]}
        assert call["name"] in declared
        arguments = json.loads(call["arguments"])
        spec = declared[call["name"]]["parameters"]
        assert set(spec["required"]) <= set(arguments) <= set(spec["properties"])
        result = json.loads(next(m["content"] for m in conversation["messages"] if m["role"] == "tool"))
        answer = next(m["content"] for m in conversation["messages"][::-1]
                      if m["role"] == "assistant" and not m.get("tool_calls") and m["content"] not in toolchat.WELCOME)
        if call["name"] == "calculate":
            a, op, b = arguments["expression"].split()
            assert result["result"] == toolchat.OPERATORS[op](int(a), int(b))
        shown = result.get("result", result.get("time", result.get("temperature")))
        assert str(shown) in answer


def _entities(call: dict) -> set[str]:
    arguments = call["arguments"] if isinstance(call["arguments"], dict) else json.loads(call["arguments"])
    if "expression" in arguments:
        a, _, b = arguments["expression"].split()
        return {a, b}
    return {str(v) for k, v in arguments.items() if k in ("city", "timezone", "value")}


def test_heldout_prompts_share_no_entity_with_training():
    train = set().union(*(_entities(c) for conv in toolchat.generate(2000, seed=0) for c in _calls(conv)))
    prompts = toolchat.heldout_prompts(200, seed=0)
    heldout = set().union(*(_entities(p["expected"]) for p in prompts))
    assert train and heldout
    assert not train & heldout
    assert {p["expected"]["name"] for p in prompts} == set(toolchat.TOOLS)
    for prompt in prompts:
        assert prompt["messages"][-1]["role"] == "user"
        assert prompt["expected"]["name"] in {t["function"]["name"] for t in prompt["tools"]}


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="non-negative"):
        toolchat.generate(-1)
    with pytest.raises(ValueError, match="plain_fraction"):
        toolchat.generate(3, plain_fraction=1.5)


def test_novel_entities_are_new_in_every_conversation_and_never_held_out():
    novel = toolchat.generate(400, seed=0, novel_fraction=1.0)
    entities = [_entities(c) for conv in novel for c in _calls(conv)]
    flat = set().union(*entities)
    assert not flat & set().union(*(_entities(p["expected"]) for p in toolchat.heldout_prompts(200, seed=0)))
    cities = [e for es in entities for e in es if e.isalpha()]
    assert cities and not set(cities) & set(toolchat.CITIES[0]) and len(set(cities)) > 0.5 * len(cities)
    assert toolchat.generate(200, seed=3, novel_fraction=0.0) == toolchat.generate(200, seed=3)
    with pytest.raises(ValueError, match="novel_fraction"):
        toolchat.generate(3, novel_fraction=1.5)
