"""`ChatFormat`: tool_choice -> forced prefix and stop tokens, stop-token stripping, parsing through the registry."""

from dataclasses import dataclass

import pytest

from openk2.chat import ChatFormat, ChatFormatError, render
from openk2.chat import registry as lazy_registry
from openk2.chat import tool_parsers as registry
from openk2.chat.tool_parsers.kimi_k2 import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, IM_END, SECTION_BEGIN, SECTION_END
from openk2.data.tokenizer import train_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["Weather in Paris? It is sunny. get_weather city Paris"] * 20, 600)


@pytest.fixture(scope="module")
def fmt(tokenizer):
    return ChatFormat(tokenizer)


@dataclass
class Result:
    """The fields of an engine result that `finish` reads."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"
    stop_reason: int | str | None = None
    text: str | None = None


def test_prepare_auto_declares_tools_and_stops_at_end_of_turn(fmt, tokenizer):
    prepared = fmt.prepare(ASK, [WEATHER])
    assert prepared.token_ids == tokenizer.encode(render(ASK, [WEATHER]), allow_special=True)
    assert prepared.prefix == ""
    assert prepared.stop_token_ids == (tokenizer.special_ids[IM_END],)
    assert fmt.prepare(ASK, [WEATHER], "auto") == prepared


def test_prepare_none_hides_tools_and_stops_at_a_section(fmt, tokenizer):
    prepared = fmt.prepare(ASK, [WEATHER], "none")
    assert prepared.token_ids == tokenizer.encode(render(ASK), allow_special=True)
    assert prepared.stop_token_ids == (tokenizer.special_ids[IM_END], tokenizer.special_ids[SECTION_BEGIN])


def test_prepare_required_and_named_force_a_call(fmt, tokenizer):
    required = fmt.prepare(ASK, [WEATHER], "required")
    assert required.prefix == f"{SECTION_BEGIN}{CALL_BEGIN}functions."
    named = fmt.prepare(ASK, [WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert named.prefix == f"{SECTION_BEGIN}{CALL_BEGIN}functions.get_weather:0{ARGUMENT_BEGIN}"
    # The prefix is part of the prompt the engine continues.
    assert named.token_ids == tokenizer.encode(render(ASK, [WEATHER]) + named.prefix, allow_special=True)


@pytest.mark.parametrize(("tools", "choice", "param", "message"), [
    (None, "required", "tool_choice", "tool_choice needs tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "not in tools"),
    ([WEATHER], {"type": "function"}, "tool_choice", "bad tool_choice"),
    ([WEATHER], "sometimes", "tool_choice", "bad tool_choice"),
])
def test_prepare_rejects_bad_tool_choice(fmt, tools, choice, param, message):
    with pytest.raises(ChatFormatError, match=message) as err:
        fmt.prepare(ASK, tools, choice)
    assert err.value.param == param


def test_prepare_names_messages_for_template_errors(fmt):
    with pytest.raises(ChatFormatError, match="unknown role") as err:
        fmt.prepare([{"role": "robot", "content": "hi"}])
    assert err.value.param == "messages"


def test_finish_strips_the_stop_token_and_parses_calls(fmt, tokenizer):
    end = tokenizer.special_ids[IM_END]
    body = tokenizer.encode('{"city": "Paris"}' + CALL_END + SECTION_END)
    result = Result(body + [end], [-0.5] * (len(body) + 1), stop_reason=end)
    assert fmt.completion_tokens(result) == (body, [-0.5] * len(body))
    prefix = fmt.prepare(ASK, [WEATHER], {"type": "function", "function": {"name": "get_weather"}}).prefix
    reply = fmt.finish(result, prefix)
    assert reply.content is None
    assert reply.finish_reason == "tool_calls"
    assert reply.tool_calls == [{"id": "functions.get_weather:0", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]


def test_finish_keeps_text_cut_at_a_stop_string_and_length_endings(fmt, tokenizer):
    ids = tokenizer.encode("It is sunny. END more")
    cut = Result(ids, [0.0] * len(ids), stop_reason="END", text="It is sunny. ")
    assert fmt.finish(cut).content == "It is sunny. "
    # A sample cut by max_tokens keeps its last token: it is content, not a stop token.
    long = Result(ids, [0.0] * len(ids), finish_reason="length")
    reply = fmt.finish(long)
    assert (reply.content, reply.tool_calls, reply.finish_reason) == ("It is sunny. END more", [], "length")


def test_malformed_calls_are_kept_without_the_parser_error(fmt, tokenizer):
    text = f"{SECTION_BEGIN}{CALL_BEGIN}functions.get_weather:0{ARGUMENT_BEGIN}not json{CALL_END}{SECTION_END}"
    ids = tokenizer.encode(text, allow_special=True)
    reply = fmt.finish(Result(ids, [0.0] * len(ids), finish_reason="length"))
    assert [c["function"]["arguments"] for c in reply.tool_calls] == ["not json"]
    assert "error" not in reply.tool_calls[0]


def test_the_registry_decides_the_parser(tokenizer, monkeypatch):
    """A format registered under another name is used by prepare, finish and streaming alike."""

    class Shouty(registry.get_tool_parser("kimi_k2")):
        name = "shouty"

        def feed(self, delta):
            return self._shout(super().feed(delta))

        def finish(self):
            return self._shout(super().finish())

        @staticmethod
        def _shout(delta):
            delta.content = delta.content.upper()
            return delta

    module = type("M", (), {"Shouty": Shouty})
    monkeypatch.setitem(registry._REGISTRY, "shouty", ("fake_module", "Shouty"))
    monkeypatch.setattr(lazy_registry.importlib, "import_module", lambda name: module)
    fmt = ChatFormat(tokenizer, "shouty")
    ids = tokenizer.encode("it is sunny")
    assert fmt.finish(Result(ids, [0.0] * len(ids), finish_reason="length")).content == "IT IS SUNNY"
    assert isinstance(fmt.stream_parser(), Shouty)
    with pytest.raises(ValueError, match="unknown tool parser"):
        ChatFormat(tokenizer, "missing")
