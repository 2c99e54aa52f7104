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
        "Singular.<|tool_call_section_begin|><|tool_call_begin|>0<|tool_call_argument_begin|>"
        '{"city": "Rome"}<|tool_call_end|><|tool_call_begin|>call_7<|tool_call_argument_begin|>{"path": "/a"}'
        "<|tool_call_end|><|tool_call_section_end|> Done.",
        "Thinking aloud.<|tool_calls_section_begin|> the answer is 4, no call after all",
    ],
}

# Declared tools the samples also run with (calls whose ids name no function resolve from these).
SAMPLE_TOOLS: dict[str, list[dict]] = {
    "kimi_k2": [
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "read_file", "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    ],
}


def parser_cases() -> list[tuple[str, str, bool]]:
    """(parser name, sample, with declared tools?) for every registered parser that has samples."""
    return [(name, text, with_tools) for name in list_tool_parsers() for text in SAMPLES.get(name, [])
            for with_tools in (False, True)]


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


@pytest.mark.parametrize(("name", "text", "with_tools"), parser_cases())
def test_streaming_over_random_splits_equals_parse(name, text, with_tools):
    cls = get_tool_parser(name)
    tools = SAMPLE_TOOLS.get(name) if with_tools else None
    expected = cls(tools).parse(text)
    assert stream(cls(tools), [text]) == expected
    assert stream(cls(tools), list(text)) == expected  # one character at a time
    rng = random.Random(f"{name}:{text}:{with_tools}")  # str seeds are hashed stably, unlike hash()
    parser = cls(tools)
    for _ in range(30):
        parser.reset()  # one instance, reused: reset must clear everything
        assert stream(parser, random_split(text, rng)) == expected


@pytest.mark.parametrize(("name", "text", "with_tools"), parser_cases())
def test_parse_results_are_well_formed(name, text, with_tools):
    result = get_tool_parser(name)(SAMPLE_TOOLS.get(name) if with_tools else None).parse(text)
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
    result = kimi().parse(SAMPLES["kimi_k2"][6])
    assert result.tool_calls == [ToolCall(0, "functions.f:0", "f", '{"x": 1}')]  # closed by the next call begin
    # A call naming no function, and one with no arguments, are dropped with a note each.
    assert len(result.dropped) == 2
    assert "'bad id!'" in result.dropped[0] and "no tools were declared" in result.dropped[0]
    assert "'functions.h:2'" in result.dropped[1] and "no <|tool_call_argument_begin|>" in result.dropped[1]


def test_kimi_k2_content_around_the_section():
    result = kimi().parse(SAMPLES["kimi_k2"][7])
    assert result.content == "Before.  After."  # text inside the section ("stray") is discarded
    assert result.tool_calls == [ToolCall(0, "functions.f:0", "f", "{}")]
    assert kimi().parse(SAMPLES["kimi_k2"][10]).content == "Stray markers are dropped."


def test_kimi_k2_output_cut_off():
    (cut,) = kimi().parse(SAMPLES["kimi_k2"][8]).tool_calls
    assert cut.arguments == '{"cut": "of' and "not valid JSON" in cut.error
    header_only = kimi().parse(SAMPLES["kimi_k2"][9])
    assert header_only.tool_calls == [] and "before the end of output" in header_only.dropped[0]


def test_kimi_k2_an_id_that_spells_a_declared_name_resolves_to_it():
    text = "<|tool_call_begin|>lookup<|tool_call_argument_begin|>{}<|tool_call_end|>"
    tools = [{"type": "function", "function": {"name": n}} for n in ("lookup", "other")]
    assert get_tool_parser("kimi_k2")(tools).parse(text).tool_calls == [ToolCall(0, "lookup", "lookup", "{}")]
    assert kimi().parse(text).tool_calls == []  # without declared tools nothing names the function


def test_kimi_k2_reset_keeps_the_declared_tools():
    parser = get_tool_parser("kimi_k2")(SAMPLE_TOOLS["kimi_k2"])
    text = SAMPLES["kimi_k2"][11]
    first = stream(parser, [text])
    parser.reset()
    assert stream(parser, [text]) == first == parser.parse(text)
    assert [c.name for c in first.tool_calls] == ["get_weather", "read_file"]


def test_kimi_k2_resolution_schema_fit_keywords():
    from openk2.chat.tool_parsers.resolve import declared_tools, fits, fits_arguments, infer_tool

    assert fits({"type": "integer"}, 3) and fits({"type": "integer"}, 3.0) and not fits({"type": "integer"}, True)
    assert not fits({"type": "number"}, False) and fits({"type": ["string", "null"]}, None)
    assert fits({"type": "array", "items": {"type": "string"}}, ["a"]) and not fits({"items": {"type": "string"}}, [1])
    assert not fits({"oneOf": [{"type": "number"}, {"type": "integer"}]}, 2)  # fits both: oneOf wants exactly one
    assert fits({"enum": [1, "a"]}, 1) and not fits({"enum": [1]}, True) and not fits({"const": False}, 0)
    assert fits({"type": "object", "properties": {"a": {"type": "object"}}}, {"a": {"free": 1}})  # nested: open
    assert not fits_arguments({"type": "object"}, {"free": 1})  # top level: undeclared keys refused
    assert fits_arguments(True, {}) and not fits_arguments(True, {"a": 1}) and not fits_arguments(False, {})
    tools = declared_tools([{"type": "function", "function": {"name": "a"}}, {"function": {"name": 3}}, "junk",
                            {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}])
    assert [t.name for t in tools] == ["a"] and tools[0].parameters == {}  # first declaration wins
    assert infer_tool((), "{}") == (None, "no tools were declared")


@pytest.mark.parametrize("call_id", ["functions.f:0", "0"])
def test_arguments_nested_past_the_recursion_limit_are_an_error_not_a_crash(call_id):
    """Model output is hostile: 5,000 nested objects fit in one max_tokens budget and overflow json's recursion."""
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("f", "g")]
    deep = '{"a":' * 5000 + "1" + "}" * 5000
    text = f"<|tool_calls_section_begin|><|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{deep}" \
           "<|tool_call_end|><|tool_calls_section_end|>"
    result = get_tool_parser("kimi_k2")(tools).parse(text)
    if call_id == "0":  # unresolvable without decodable arguments: dropped, with a note
        assert result.tool_calls == [] and len(result.dropped) == 1
    else:
        assert "nested too deeply" in result.tool_calls[0].error
