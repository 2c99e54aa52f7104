"""Tool-call parsers: a conformance suite every registered parser runs, plus K2-specific behaviour."""

import random
import sys

import pytest

from openk2.chat.tool_parsers import (
    DeltaMessage,
    ParseResult,
    StreamAccumulator,
    ToolCall,
    ToolParser,
    get_tool_parser,
    list_tool_parsers,
)

# Conformance samples per registered parser: model outputs, well formed or not. A parser registered
# without samples here fails test_every_registered_parser_is_tested.
SAMPLES: dict[str, list[str]] = {
    "kimi_k2": [
        "",
        "Just an answer.<|im_end|>",
        "No end token, and a < sign, an <| that is no marker, and <|im_end",
        "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
        '{"tz": "CET", "note": "a <b> tag"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>ignored',
        "<|tool_calls_section_begin|>\n <|tool_call_begin|> functions.get_weather.v2:3 \n<|tool_call_argument_begin|>"
        '\n  {"city":  "Oslo",\n "days": 3}  \n <|tool_call_end|>\n<|tool_calls_section_end|>\n\n',
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        '{"a": <|tool_call_end|><|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>[1]<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"x": 1}<|tool_call_begin|>bad id!'
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_call_begin|>functions.h:2<|tool_call_end|>",
        "Before.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|>stray<|tool_calls_section_end|>  After.<|im_end|>",
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"cut": "of',
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0",
        "Stray <|tool_call_end|>markers<|tool_calls_section_end|> are dropped.<|tool_call_argument_begin|>",
    ],
}


def parser_cases() -> list[tuple[str, str]]:
    """(parser name, sample) for every registered parser that has samples."""
    return [(name, text) for name in list_tool_parsers() for text in SAMPLES.get(name, [])]


def stream(parser: ToolParser, pieces: list[str]) -> ParseResult:
    """Feed `pieces` one by one, finish, and assemble what came out."""
    acc = StreamAccumulator()
    for piece in pieces:
        acc.add(parser.feed(piece))
    acc.add(parser.finish())
    return acc.result()


def random_split(text: str, rng: random.Random) -> list[str]:
    """`text` cut at random places into pieces of 1 to 12 characters (some empty pieces too)."""
    pieces, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 12)
        pieces.append(text[i:j])
        if rng.random() < 0.1:
            pieces.append("")
        i = j
    return pieces


# ---- conformance: every registered parser ----


def test_every_registered_parser_is_tested():
    module = sys.modules[__name__]
    for name in list_tool_parsers():
        assert SAMPLES.get(name), f"tool parser {name!r} is registered but has no conformance samples"
        own_tests = [t for t in dir(module) if t.startswith(f"test_{name}_")]
        assert own_tests, f"tool parser {name!r} is registered but has no test_{name}_* tests"


@pytest.mark.parametrize("name", list_tool_parsers())
def test_registry_returns_a_tool_parser(name):
    cls = get_tool_parser(name)
    assert issubclass(cls, ToolParser) and cls.name == name


def test_unknown_parser_name_raises_value_error():
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        get_tool_parser("nope")


@pytest.mark.parametrize(("name", "text"), parser_cases())
def test_streaming_over_random_splits_equals_parse(name, text):
    cls = get_tool_parser(name)
    expected = cls().parse(text)
    assert stream(cls(), [text]) == expected
    assert stream(cls(), list(text)) == expected  # one character at a time
    rng = random.Random(f"{name}:{text}")  # str seeds are hashed stably, unlike hash()
    parser = cls()
    for _ in range(30):
        parser.reset()  # one instance, reused: reset must clear everything
        assert stream(parser, random_split(text, rng)) == expected


@pytest.mark.parametrize(("name", "text"), parser_cases())
def test_parse_results_are_well_formed(name, text):
    result = get_tool_parser(name)().parse(text)
    assert isinstance(result.content, str)
    for i, call in enumerate(result.tool_calls):
        assert call.index == i
        assert isinstance(call.id, str) and isinstance(call.name, str) and isinstance(call.arguments, str)
        openai = call.to_openai()
        assert openai["type"] == "function" and ("error" in openai) == (call.error is not None)


@pytest.mark.parametrize("name", list_tool_parsers())
def test_finished_parser_refuses_more_input(name):
    parser = get_tool_parser(name)()
    parser.feed("hi")
    parser.finish()
    with pytest.raises(ValueError):
        parser.feed("more")
    with pytest.raises(ValueError):
        parser.finish()
    parser.reset()
    assert stream(parser, ["again"]).content == "again"


def test_accumulator_rejects_a_broken_stream():
    acc = StreamAccumulator()
    with pytest.raises(ValueError, match="never opened"):
        acc.add(DeltaMessage(tool_calls=[{"index": 0, "function": {"arguments": "{}"}}]))
    with pytest.raises(ValueError, match="out of order"):
        acc.add(DeltaMessage(tool_calls=[{"index": 1, "id": "x", "type": "function", "function": {"name": "f"}}]))


# ---- kimi_k2 ----


def kimi() -> ToolParser:
    """A fresh K2 parser."""
    return get_tool_parser("kimi_k2")()


def test_kimi_k2_streams_openai_shaped_deltas():
    parser = kimi()
    assert parser.feed("Let me check. <|tool_ca") == DeltaMessage(content="Let me check. ")
    assert parser.feed("lls_section_begin|><|tool_call_begin|>functions.get_weather:0").is_empty()
    first = parser.feed('<|tool_call_argument_begin|>{"city": ')
    assert first.tool_calls == [
        {
            "index": 0,
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        },
        {"index": 0, "function": {"arguments": '{"city":'}},
    ]
    assert parser.feed('"Paris"} \n<|tool_call_e').tool_calls == [{"index": 0, "function": {"arguments": ' "Paris"}'}}]
    assert parser.feed("nd|><|tool_calls_section_end|><|im_end|>").is_empty()
    assert parser.finish().is_empty()


def test_kimi_k2_holds_back_only_what_could_be_a_marker():
    parser = kimi()
    assert parser.feed("a <").content == "a "
    assert parser.feed(" b <|x").content == "< b <|x"  # "<|x" can never become a marker
    assert parser.feed("<|im_").content == ""
    assert parser.finish().content == "<|im_"  # the end of output settles it: plain text


def test_kimi_k2_several_calls_and_content():
    result = kimi().parse(SAMPLES["kimi_k2"][3])
    assert result == ParseResult(
        "Checking.",
        [
            ToolCall(0, "functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
            ToolCall(1, "functions.get_time:1", "get_time", '{"tz": "CET", "note": "a <b> tag"}'),
        ],
    )


def test_kimi_k2_whitespace_between_markers_is_ignored():
    result = kimi().parse(SAMPLES["kimi_k2"][4])
    assert result == ParseResult(
        "", [ToolCall(0, "functions.get_weather.v2:3", "get_weather.v2", '{"city":  "Oslo",\n "days": 3}')]
    )


def test_kimi_k2_malformed_calls_are_reported_not_raised():
    calls = kimi().parse(SAMPLES["kimi_k2"][5]).tool_calls
    assert [c.name for c in calls] == ["f", "g"]
    assert "not valid JSON" in calls[0].error and calls[0].arguments == '{"a":'
    assert "must be a JSON object" in calls[1].error
    calls = kimi().parse(SAMPLES["kimi_k2"][6]).tool_calls
    assert calls[0] == ToolCall(0, "functions.f:0", "f", '{"x": 1}')  # closed by the next <|tool_call_begin|>
    assert calls[1].id == "bad id!" and "malformed tool-call id" in calls[1].error
    assert calls[2].name == "h" and "no <|tool_call_argument_begin|>" in calls[2].error


def test_kimi_k2_content_around_the_section():
    result = kimi().parse(SAMPLES["kimi_k2"][7])
    assert result.content == "Before.  After."  # text inside the section ("stray") is discarded
    assert result.tool_calls == [ToolCall(0, "functions.f:0", "f", "{}")]
    assert kimi().parse(SAMPLES["kimi_k2"][10]).content == "Stray markers are dropped."


def test_kimi_k2_output_cut_off():
    (cut,) = kimi().parse(SAMPLES["kimi_k2"][8]).tool_calls
    assert cut.arguments == '{"cut": "of' and "not valid JSON" in cut.error
    (header_only,) = kimi().parse(SAMPLES["kimi_k2"][9]).tool_calls
    assert header_only.name == "f" and "before the end of output" in header_only.error


def test_kimi_k2_ids_without_prefix_or_index_still_name_the_function():
    text = "<|tool_call_begin|>lookup<|tool_call_argument_begin|>{}<|tool_call_end|>"
    assert kimi().parse(text).tool_calls == [ToolCall(0, "lookup", "lookup", "{}")]
