"""Structured output through one path: random schemas decode to valid JSON on the local engine (a random K2
checkpoint) and through the `openai:` backend against a real `openk2 serve`; retries and reasons of `chat_json`."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("openai")
pytest.importorskip("fastapi")

from openk2.llm import load_chat_model  # noqa: E402
from openk2.llm.base import ChatModel, ChatResponse  # noqa: E402
from openk2.llm.finisher import Finisher, reserve_for, smallest_instance  # noqa: E402
from openk2.llm.structured import chat_json, json_schema_format  # noqa: E402
from tests.infer import test_server as _srv  # noqa: E402
from tests.llm.random_schemas import random_scalar, random_schema, schema_errors  # noqa: E402

checkpoint, real_server = _srv.checkpoint, _srv.real_server
ASK = [{"role": "user", "content": "Hello, how are you? Answer in JSON."}]


@pytest.fixture(scope="module")
def local(checkpoint):
    return load_chat_model(f"local:{checkpoint}", max_seq_len=1024, device="cpu", dtype="float32",
                           max_string_length=16)


@pytest.mark.parametrize("seed", range(6))
def test_local_random_schema_always_parses(local, seed):
    """A random-weight model under the grammar: every sample is JSON of the schema, even with a tight budget."""
    schema = random_schema(random.Random(seed))
    budget = 2 * reserve_for(schema)  # the documented bound: half of it may be spent closing the JSON
    replies = local.chat(ASK, max_tokens=budget, temperature=1.0, n=2, seed=seed,
                         response_format=json_schema_format(schema))
    for r in replies:
        value = json.loads(r.content)
        assert schema_errors(value, schema) == [], (schema, r.content)
        assert r.usage["completion_tokens"] <= 2 * budget


@pytest.mark.parametrize("seed", range(3))
def test_local_forced_tool_call_valid_arguments(local, seed):
    rng = random.Random(100 + seed)
    tools = [{"type": "function", "function": {"name": f"tool_{k}", "description": "d",
                                               "parameters": random_schema(rng, max_depth=1)}} for k in range(2)]
    [r] = local.chat(ASK, tools=tools, tool_choice="required", max_tokens=60, temperature=1.0, seed=seed)
    assert r.finish_reason == "tool_calls" and r.tool_calls
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in r.tool_calls:
        args = json.loads(call["function"]["arguments"])
        assert schema_errors(args, by_name[call["function"]["name"]]) == []


def test_openai_backend_passes_response_format_to_serve(real_server):
    """The openai: backend sends response_format; the real server decodes under its grammar."""
    schema = {"type": "object", "properties": {"verdict": {"enum": ["YES", "NO"]}, "ok": {"type": "boolean"},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["verdict", "ok", "score"]}
    remote = load_chat_model(f"openai:{real_server.base}/v1#{_srv.MODEL}", timeout=60, max_retries=1)
    try:
        for seed in range(3):
            got = chat_json(remote, ASK, schema, max_attempts=1, max_tokens=40, temperature=1.0, seed=seed)
            assert got.ok, got
            assert schema_errors(got.value, schema) == []
    finally:
        remote.close()


class Scripted(ChatModel):
    def __init__(self, replies):
        self.replies, self.seen = list(replies), []

    def chat(self, messages, tools=None, **sampling):
        self.seen.append((list(messages), sampling))
        return [self.replies.pop(0)]


def test_chat_json_reasons_and_bounded_retries():
    def needs_a(value):
        if "a" not in value:
            raise ValueError("no key a")
        return value["a"]

    model = Scripted([ChatResponse(content='{"a": "unfinish', finish_reason="length"),
                      ChatResponse(content="prose only", finish_reason="stop"),
                      ChatResponse(content='{"b": 1}', finish_reason="stop")])
    got = chat_json(model, ASK, {"type": "object"}, needs_a, max_attempts=3, max_tokens=5)
    assert not got.ok and got.value is None and got.attempts == 3
    assert got.failures == ["truncated", "no_json", "invalid"] and got.reason == "invalid"
    assert "no key a" in got.error
    assert model.seen[0][1]["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "reply", "schema": {"type": "object"}, "strict": True}}
    assert "no key a" in model.seen[-1][0][-1]["content"] or len(model.seen) == 3
    ok = chat_json(Scripted([ChatResponse(content='```json\n{"a": 2}\n```')]), ASK, None, needs_a)
    assert ok.ok and ok.value == 2 and ok.failures == []


def test_finisher_closes_open_string_and_objects():
    # token vocabulary: single bytes of interest plus a multi-byte one; 99 is the end token
    vocab = [b'"', b"}", b"]", b",", b"a", b"0", b"ab", b"{"] + [b""] * 91 + [b"<end>"]
    fin = Finisher(vocab, end_ids=[99], max_tokens=10, reserve=10)
    fin.advance(7)  # {
    fin.advance(0)  # "  -> inside a string
    assert fin.in_string and fin.pick([0, 1, 4, 6]) == 0  # close the string first, not `}`
    fin.advance(0)
    assert not fin.in_string and fin.pick([1, 3, 4]) == 1
    assert fin.pick([1, 99]) == 99


def test_smallest_instance():
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"enum": ["long one", "x"]},
                                               "c": {"type": "array", "items": random_scalar(random.Random(0)),
                                                     "minItems": 1}},
              "required": ["b", "c"]}
    value = smallest_instance(schema)
    assert value["b"] == "x" and len(value["c"]) == 1 and "a" not in value
