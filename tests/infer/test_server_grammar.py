"""Constrained decoding end to end: the official `openai` client against a real `openk2 serve` subprocess on an
untrained tiny checkpoint. Forced tool calls (required, named) must name a declared tool with arguments that
validate against its schema; response_format json_object / json_schema must be honoured; what the server
answers must be accepted when sent back."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Beijing", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "units": {"type": "string", "enum": ["metric", "imperial"]}},
    "required": ["city"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {
    "guest": {"type": "object", "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
              "required": ["name"]},
    "nights": {"type": "integer", "minimum": 1},
    "extras": {"type": "array", "items": {"type": "string", "enum": ["breakfast", "parking"]}, "maxItems": 2}},
    "required": ["guest", "nights"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "book_room", "description": "Book", "parameters": BOOK}}]
SCHEMAS = {"get_weather": WEATHER, "book_room": BOOK}
ASK = [{"role": "user", "content": "Book me a room in Lima and tell me the weather."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.infer.test_server import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-grammar",
                                 ['{"city": "Paris", "days": 3} weather booking'])
    port = _free_port()
    code = ("import sys; from openk2.cli.serve import serve_main; "
            f"sys.exit(serve_main(['--checkpoint', {str(ckpt)!r}, '--port', '{port}', '--max-seq-len', '1536', "
            "'--device', 'cpu', '--log-level', 'warning', '--grammar-max-string-length', '24']))")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        try:
            httpx.get(base + "/v1/models", timeout=5)
            break
        except httpx.TransportError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise AssertionError(proc.communicate(timeout=5)[0].decode()[-2000:]) from None
            time.sleep(0.2)
    yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120), ckpt.name
    proc.terminate()
    proc.wait(timeout=30)


def _valid_calls(message) -> list[tuple[str, dict]]:
    assert message.tool_calls, f"no tool call in {message}"
    out = []
    for call in message.tool_calls:
        name = call.function.name
        assert name in SCHEMAS, f"undeclared tool {name!r}"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[name])
        out.append((name, args))
    return out


def test_required_and_named_calls_are_always_schema_valid(server):
    client, model = server
    required = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                              n=6, temperature=1.0, seed=3, max_tokens=300)
    named = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, n=6, temperature=1.0, seed=4, max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "book_room"}})
    for choice in required.choices + named.choices:
        assert choice.finish_reason == "tool_calls"
        _valid_calls(choice.message)
    assert all(name == "book_room" for c in named.choices for name, _ in _valid_calls(c.message))
    # The reply goes back into the conversation unchanged (with a tool result) and is accepted.
    msg = required.choices[0].message
    history = ASK + [msg.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in msg.tool_calls]
    again = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=4)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_response_format_json_schema_and_json_object(server):
    client, model = server
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    r = client.chat.completions.create(model=model, messages=ASK, response_format=fmt, n=4, temperature=1.0,
                                       seed=5, max_tokens=200)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), WEATHER)
    r = client.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"},
                                       temperature=0, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_bad_response_format_is_a_400(server):
    client, model = server
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=model, messages=ASK, response_format={"type": "yaml"}, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=2,
                                       response_format={"type": "json_schema", "json_schema": "nope"})
