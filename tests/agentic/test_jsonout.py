"""Structured JSON from chat models: extraction from messy replies, validation, bounded retries, counting."""

from __future__ import annotations

import asyncio

import pytest

from openk2.agentic.jsonout import JSONStats, ask_json, extract_json
from openk2.llm.base import ChatModel, ChatResponse


@pytest.mark.parametrize("text,expected", [
    ('{"a": 1}', {"a": 1}),
    ('Sure!\n```json\n{"a": [1, 2]}\n```\nHope that helps.', {"a": [1, 2]}),
    ('The answer is [1, {"b": 2}] as requested', [1, {"b": 2}]),
    ('broken {"a": 1 then valid {"b": 2}', {"b": 2}),
    ('```\n{"x": "y"}\n``` and later {"z": 1}', {"x": "y"}),
])
def test_extract_json(text, expected):
    assert extract_json(text) == expected


@pytest.mark.parametrize("text", ["", "no json here", "{broken", None])
def test_extract_json_fails(text):
    with pytest.raises(ValueError):
        extract_json(text)


class Replies(ChatModel):
    def __init__(self, replies):
        self.replies = list(replies)
        self.seen = []

    def chat(self, messages, tools=None, **sampling):
        self.seen.append(list(messages))
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return [ChatResponse(content=reply)]


def _needs_name(value):
    if not isinstance(value, dict) or "name" not in value:
        raise ValueError("missing 'name'")
    return value["name"].upper()


def test_ask_json_retries_with_feedback_and_counts():
    model = Replies(["no idea", RuntimeError("backend hiccup"), '{"other": 1}', 'ok: {"name": "x"}'])
    stats = JSONStats()
    got = asyncio.run(ask_json(model, [{"role": "user", "content": "give json"}], _needs_name, max_attempts=4,
                               stats=stats))
    assert got == "X"
    assert stats.as_dict() == {"requests": 1, "attempts": 4, "succeeded": 1, "gave_up": 0,
                               "failures": {"invalid": 1, "model_error": 1, "no_json": 1}}
    # the model is shown its bad reply and what was wrong with it
    assert model.seen[-1][-2] == {"role": "assistant", "content": '{"other": 1}'}
    assert "missing 'name'" in model.seen[-1][-1]["content"]


def test_ask_json_gives_up_after_bounded_attempts():
    model = Replies(["nope"] * 5)
    stats = JSONStats()
    assert asyncio.run(ask_json(model, [{"role": "user", "content": "q"}], max_attempts=2, stats=stats)) is None
    assert stats.attempts == 2 and stats.gave_up == 1 and len(model.replies) == 3
    with pytest.raises(ValueError):
        asyncio.run(ask_json(model, [], max_attempts=0))
