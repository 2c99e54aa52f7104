"""Strict `auto` tool calls streamed: the official `openai` client against a real `openk2 serve --strict-tool-calls`
subprocess on a tiny untrained checkpoint. Under `auto` a sample may answer in text or open a call section; once
it opens one, the grammar holds, so every call the client assembles from the stream names a declared tool with
arguments that validate, and the samples that never open one keep their free text."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from k2vv.launch import start_server, stop_server, write_tiny_checkpoint  # noqa: E402

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-strict")
    proc, base = start_server(ckpt, ["--strict-tool-calls", "--grammar-max-string-length", "16",
                                     "--max-seq-len", "2048"])
    yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)
    stop_server(proc)


@pytest.mark.slow
def test_streamed_strict_auto_calls_are_schema_valid(client):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    model = client.models.list().data[0].id
    # Seeded: with this seed 2 of the 8 untrained samples open a call section and the others stay text.
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Lima?"}], tools=TOOLS, tool_choice="auto",
        n=8, temperature=1.0, seed=11, max_tokens=160, stream=True))
    assert all(len(ch.choices) == 1 for ch in chunks)  # one choice entry per chunk (OpenAI's protocol)
    first_call_delta: dict[int, object] = {}
    for ch in chunks:
        c = ch.choices[0]
        for tc in c.delta.tool_calls or []:
            first_call_delta.setdefault((c.index, tc.index), tc)
    for tc in first_call_delta.values():  # id, type and name come first, arguments follow in fragments
        assert tc.id and tc.type == "function" and tc.function.name == "get_weather"
    state = ChatCompletionStreamState()
    for ch in chunks:
        state.handle_chunk(ch)
    choices = state.current_completion_snapshot.choices
    assert sorted(c.index for c in choices) == list(range(8))
    called = [c for c in choices if c.finish_reason == "tool_calls"]
    assert called, "no sample opened a call section: the test checks nothing"
    for c in called:
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    text = [c for c in choices if c.finish_reason != "tool_calls"]
    assert text and all(not c.message.tool_calls and c.message.content for c in text)  # auto, not required
    # What the server streamed goes back into the conversation and is accepted.
    msg = called[0].message
    history = [{"role": "user", "content": "Weather in Lima?"}, msg.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"} for call in msg.tool_calls]
    again = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=4)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
