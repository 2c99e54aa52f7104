"""`openk2 chat` (`chat_main`) driven with a fake ChatModel and scripted stdin."""

from __future__ import annotations

import copy
import io
import json

import pytest

from openk2.cli import chat as chat_cli
from openk2.llm.base import ChatModel, ChatResponse

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


class FakeModel(ChatModel):
    name = "fake"

    def __init__(self, script=None):
        self.calls: list[dict] = []
        self.script = list(script or [])
        self.closed = False

    def chat(self, messages, tools=None, **sampling):
        self.calls.append({"messages": copy.deepcopy(list(messages)), "tools": tools, "sampling": sampling})
        if self.script:
            return [self.script.pop(0)]
        last = messages[-1]["content"]
        return [ChatResponse(content=f"echo {last}", finish_reason="stop")]

    def close(self):
        self.closed = True


def _tool_reply(city="Paris"):
    return ChatResponse(content=None, finish_reason="tool_calls", tool_calls=[
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}])


def run(monkeypatch, argv, lines, model):
    seen = []
    monkeypatch.setattr(chat_cli, "load_chat_model", lambda spec: seen.append(spec) or model)
    out = io.StringIO()
    rc = chat_cli.chat_main(argv, stdin=io.StringIO("".join(f"{x}\n" for x in lines)), stdout=out)
    assert seen == [argv[argv.index("--model") + 1]]
    return rc, out.getvalue()


def test_history_and_eof(monkeypatch):
    model = FakeModel()
    rc, out = run(monkeypatch, ["--model", "hf:smollm2", "--system", "be nice", "--temperature", "0",
                                "--max-tokens", "7"], ["hi", "", "again"], model)
    assert rc == 0 and model.closed
    assert "assistant> echo hi" in out and "assistant> echo again" in out
    assert len(model.calls) == 2
    assert model.calls[1]["messages"] == [
        {"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "echo hi"}, {"role": "user", "content": "again"}]
    assert model.calls[0]["sampling"] == {"temperature": 0.0, "max_tokens": 7}
    assert model.calls[0]["tools"] is None


def test_reset_and_exit(monkeypatch):
    model = FakeModel()
    rc, out = run(monkeypatch, ["--model", "local:x", "--system", "sys"], ["one", "/reset", "two", "/exit", "never"],
                  model)
    assert rc == 0 and "(history cleared)" in out
    assert model.calls[1]["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "two"}]
    assert len(model.calls) == 2  # nothing after /exit


def test_tool_call_interactive(monkeypatch, tmp_path):
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    model = FakeModel([_tool_reply(), ChatResponse(content="It is sunny.", finish_reason="stop")])
    rc, out = run(monkeypatch, ["--model", "openai:http://x/v1#m", "--tools", str(tmp_path / "tools.json")],
                  ["weather?", '{"sky": "sunny"}'], model)
    assert rc == 0
    assert 'tool call> get_weather({"city": "Paris"})' in out
    assert "assistant> It is sunny." in out
    assert model.calls[0]["tools"] == TOOLS
    msgs = model.calls[1]["messages"]
    assert msgs[1]["tool_calls"][0]["id"] == "call_1"
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"sky": "sunny"}'}


def test_tool_call_stub_and_round_limit(monkeypatch, tmp_path):
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    model = FakeModel([_tool_reply("A"), _tool_reply("B"), _tool_reply("C")])
    rc, out = run(monkeypatch, ["--model", "hf:x", "--tools", str(tmp_path / "tools.json"), "--no-interactive-tools",
                                "--max-tool-rounds", "2"], ["go"], model)
    assert rc == 0 and len(model.calls) == 2
    assert out.count('tool result> {"error": "no executor"}') == 2
    assert "(stopped after 2 tool rounds)" in out
    assert model.calls[1]["messages"][2]["content"] == chat_cli.NO_EXECUTOR


def test_eof_during_tool_result_and_errors(monkeypatch, tmp_path):
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    rc, _ = run(monkeypatch, ["--model", "hf:x", "--tools", str(tmp_path / "tools.json")], ["go"],
                FakeModel([_tool_reply()]))
    assert rc == 0

    class Boom(FakeModel):
        def chat(self, messages, tools=None, **sampling):
            self.calls.append({"messages": copy.deepcopy(list(messages))})
            if len(self.calls) == 1:
                raise RuntimeError("backend down")
            return [ChatResponse(content="ok")]

    boom = Boom()
    rc, out = run(monkeypatch, ["--model", "hf:x"], ["a", "b"], boom)
    assert rc == 0 and "error: RuntimeError: backend down" in out
    assert boom.calls[1]["messages"] == [{"role": "user", "content": "b"}]  # the failed turn was dropped


def test_bad_tools_and_load_failure(monkeypatch, tmp_path, capsys):
    (tmp_path / "bad.json").write_text('{"nope": 1}')
    assert chat_cli.chat_main(["--model", "hf:x", "--tools", str(tmp_path / "bad.json")],
                              stdin=io.StringIO(""), stdout=io.StringIO()) == 2

    def fail(spec):
        raise ValueError("no such model")

    monkeypatch.setattr(chat_cli, "load_chat_model", fail)
    assert chat_cli.chat_main(["--model", "hf:x"], stdin=io.StringIO(""), stdout=io.StringIO()) == 1
    assert "no such model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        chat_cli.chat_main([], stdin=io.StringIO(""), stdout=io.StringIO())


def test_mcp_tools_are_executed_for_real(monkeypatch):
    """A real mcp-server-time over stdio: its tools are offered, the model's call runs for real and is shown."""
    call = ChatResponse(content=None, finish_reason="tool_calls", tool_calls=[
        {"id": "call_t", "type": "function",
         "function": {"name": "get_current_time", "arguments": json.dumps({"timezone": "Asia/Tokyo"})}}])
    model = FakeModel([call, ChatResponse(content="It is evening in Tokyo.", finish_reason="stop")])
    rc, out = run(monkeypatch, ["--model", "hf:x", "--mcp", "python -m mcp_server_time --local-timezone UTC"],
                  ["time in Tokyo?"], model)
    assert rc == 0
    offered = {t["function"]["name"] for t in model.calls[0]["tools"]}
    assert {"get_current_time", "convert_time"} <= offered
    assert "(2 tools, 2 from MCP)" in out
    assert 'tool call> get_current_time({"timezone": "Asia/Tokyo"})' in out
    result = json.loads(model.calls[1]["messages"][2]["content"])
    assert result["timezone"] == "Asia/Tokyo" and result["datetime"].endswith("+09:00")
    assert f"tool result> {model.calls[1]['messages'][2]['content']}" in out
    assert "assistant> It is evening in Tokyo." in out


def test_mcp_bad_command(monkeypatch, capsys):
    model = FakeModel()
    monkeypatch.setattr(chat_cli, "load_chat_model", lambda spec: model)
    rc = chat_cli.chat_main(["--model", "hf:x", "--mcp", "no-such-mcp-server-binary"], stdin=io.StringIO(""),
                            stdout=io.StringIO())
    assert rc == 2 and model.closed
    assert "no-such-mcp-server-binary" in capsys.readouterr().err
