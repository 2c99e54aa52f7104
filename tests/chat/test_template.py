"""K2's chat templates, byte for byte: one golden prompt per conversation shape, written from the behaviour of
the chat template shipped with Kimi-K2-Instruct-0905 (and K2-Thinking's) under HF's jinja rules; plus the
assistant mask, the marker/content split, the optional id normalisation, errors and output parsing."""

import json

import pytest

from openk2.chat.template import GENERATION_PROMPT, parse_assistant, render, render_pieces, render_with_mask

SYS = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
GEN = "<|im_assistant|>assistant<|im_middle|>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo of a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
    },
}
WEATHER_JSON = ('[{"function": {"description": "Météo of a city", "name": "get_weather", "parameters": '
                '{"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}, '
                '"type": "function"}]')


def call(call_id, name, arguments):
    """An OpenAI-shaped tool call."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def weather_round(id0="call_abc", id1="weird@id"):
    """User asks, assistant makes two parallel calls with content, both results come back."""
    return [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking both.",
         "tool_calls": [call(id0, "get_weather", '{"city": "Paris"}'), call(id1, "get_weather", {"city": "Rome"})]},
        {"role": "tool", "tool_call_id": id0, "content": '{"weather": "Sunny"}'},
        {"role": "tool", "tool_call_id": id1, "name": "get_weather", "content": "Rain"},
    ]


# ---- golden prompts, one per shape ----

GOLDEN = {
    "user only: default system prompt first": (
        [{"role": "user", "content": "Hi"}], None, True,
        SYS + "<|im_user|>user<|im_middle|>Hi<|im_end|>" + GEN),
    "system and history, prefill: the last turn stays open": (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}], None, False,
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|><|im_user|>user<|im_middle|>2+2?"),
    "assistant prefill continues the reply": (
        [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "The colour is"}], None, False,
        SYS + "<|im_user|>user<|im_middle|>Name a colour<|im_end|><|im_assistant|>assistant<|im_middle|>The colour is"),
    "developer is its own system-token turn, after the default system prompt": (
        [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}], None, True,
        SYS + "<|im_system|>developer<|im_middle|>Answer in French.<|im_end|>"
              "<|im_user|>user<|im_middle|>Hi<|im_end|>" + GEN),
    "system then developer": (
        [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}, {"role": "user", "content": "U"}],
        None, True,
        "<|im_system|>system<|im_middle|>S<|im_end|><|im_system|>developer<|im_middle|>D<|im_end|>"
        "<|im_user|>user<|im_middle|>U<|im_end|>" + GEN),
    "name replaces the role; an empty name does not": (
        [{"role": "user", "name": "alice", "content": "Hi"}, {"role": "assistant", "name": "", "content": "Yo"}],
        None, True,
        SYS + "<|im_user|>alice<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>Yo<|im_end|>" + GEN),
    "content parts are joined with nothing between": (
        [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "Hi"}]}], None, True,
        SYS + "<|im_user|>user<|im_middle|>Hello, world<|im_end|><|im_assistant|>assistant<|im_middle|>Hi<|im_end|>"
        + GEN),
    "tools: '# Tools' header, sorted keys, default separators, non-ASCII kept": (
        [{"role": "user", "content": "Hi"}], [WEATHER], True,
        "<|im_system|>tool_declare<|im_middle|>\n  # Tools\n  " + WEATHER_JSON + "<|im_end|>" + SYS
        + "<|im_user|>user<|im_middle|>Hi<|im_end|>" + GEN),
    "parallel calls with client ids verbatim, dict arguments as tojson, results": (
        weather_round(), [WEATHER], True,
        "<|im_system|>tool_declare<|im_middle|>\n  # Tools\n  " + WEATHER_JSON + "<|im_end|>" + SYS
        + "<|im_user|>user<|im_middle|>Weather in Paris and Rome?<|im_end|>"
        '<|im_assistant|>assistant<|im_middle|>Checking both.<|tool_calls_section_begin|>'
        '<|tool_call_begin|>call_abc<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>weird@id<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        '<|im_system|>tool<|im_middle|>## Return of call_abc\n    {"weather": "Sunny"}<|im_end|>'
        "<|im_system|>get_weather<|im_middle|>## Return of weird@id\n    Rain<|im_end|>" + GEN),
    "K2 ids, no content, a tool result last without a generation prompt": (
        [{"role": "user", "content": "t?"},
         {"role": "assistant", "content": None, "tool_calls": [call("functions.get_time:0", "get_time", "{}")]},
         {"role": "tool", "tool_call_id": "functions.get_time:0", "content": "noon"}], None, False,
        SYS + "<|im_user|>user<|im_middle|>t?<|im_end|><|im_assistant|>assistant<|im_middle|>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_time:0\n    noon"),
    "ids that are not functions.NAME:IDX stay as they are": (
        [{"role": "user", "content": "x"},
         {"role": "assistant", "tool_calls": [call("0", "f", "{}"), call("functions.invalid.0", "g", "{}")]}],
        None, True,
        SYS + "<|im_user|>user<|im_middle|>x<|im_end|><|im_assistant|>assistant<|im_middle|>"
        "<|tool_calls_section_begin|><|tool_call_begin|>0<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_call_begin|>functions.invalid.0<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|><|im_end|>" + GEN),
    "a tool result in parts is written as the template's {{ }} writes a list": (
        [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call("a", "f", "{}")]},
         {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "it's"}]}], None, True,
        SYS + "<|im_user|>user<|im_middle|>x<|im_end|><|im_assistant|>assistant<|im_middle|>"
        "<|tool_calls_section_begin|><|tool_call_begin|>a<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|><|im_end|><|im_system|>tool<|im_middle|>## Return of a\n"
        "    [{'type': 'text', 'text': \"it's\"}]<|im_end|>" + GEN),
    "an empty tool_calls list is no call section": (
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": []}], None, False,
        SYS + "<|im_user|>user<|im_middle|>q<|im_end|><|im_assistant|>assistant<|im_middle|>a"),
}


@pytest.mark.parametrize("shape", list(GOLDEN))
def test_golden_prompt(shape):
    messages, tools, add_generation_prompt, expected = GOLDEN[shape]
    assert render(messages, tools, add_generation_prompt) == expected


THINKING = [
    {"role": "user", "content": "q1"},
    {"role": "assistant", "reasoning_content": "r1", "content": "a1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "reasoning_content": "r2", "tool_calls": [call("functions.f:0", "f", "{}")]},
    {"role": "tool", "tool_call_id": "functions.f:0", "content": [{"type": "text", "text": "res"}]},
]


def test_golden_thinking_prompt_drops_finished_turns_reasoning_only():
    text = render(THINKING, [{"type": "function", "function": {"name": "f"}}], template="kimi_k2_thinking")
    assert text == (
        '<|im_system|>tool_declare<|im_middle|>[{"function": {"name": "f"}, "type": "function"}]<|im_end|>' + SYS
        + "<|im_user|>user<|im_middle|>q1<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>a1<|im_end|>"  # a finished turn: reasoning dropped
        "<|im_user|>user<|im_middle|>q2<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>r2</think><|tool_calls_section_begin|>"  # the loop: kept
        "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
        "<|im_end|><|im_system|>tool<|im_middle|>## Return of functions.f:0\nres<|im_end|>" + GEN)
    # Without a generation prompt every turn is still closed.
    assert render(THINKING[:2], template="kimi_k2_thinking", add_generation_prompt=False).endswith(
        "<think></think>a1<|im_end|>")


def test_tool_declaration_does_not_depend_on_key_order():
    shuffled = {"function": dict(reversed(list(WEATHER["function"].items()))), "type": "function"}
    ask = [{"role": "user", "content": "Hi"}]
    assert render(ask, [shuffled]) == render(ask, [WEATHER])
    assert "tool_declare" not in render(ask, tools=[])


def test_normalized_ids_follow_the_vendor_verifier_advice():
    messages = weather_round("call_abc", "functions.get_weather:1")
    messages += [{"role": "assistant", "content": None, "tool_calls": [call("call_xyz", "get_time", "{}")]},
                 {"role": "tool", "tool_call_id": "call_xyz", "content": "noon"},
                 {"role": "tool", "tool_call_id": "unknown", "content": "?"}]
    text = render(messages, normalize_ids=True)
    for k2_id in ("functions.get_weather:0", "functions.get_weather:1", "functions.get_time:2"):
        assert f"<|tool_call_begin|>{k2_id}<|tool_call_argument_begin|>" in text
        assert f"## Return of {k2_id}\n    " in text
    assert "call_abc" not in text and "call_xyz" not in text and "## Return of unknown\n" in text
    # A generated id skips one already taken; off by default.
    taken = [{"role": "user", "content": "x"},
             {"role": "assistant", "tool_calls": [call("functions.f:1", "f", "{}"), call("call_q", "f", "{}")]}]
    assert "<|tool_call_begin|>functions.f:2<" in render(taken, normalize_ids=True)
    assert "<|tool_call_begin|>call_q<" in render(taken)


# ---- pieces: markers, content and the assistant mask ----


def test_pieces_tag_markers_content_and_assistant_output():
    messages = weather_round() + [{"role": "assistant", "content": "Sunny in Paris, rain in Rome."}]
    pieces = render_pieces(messages, [WEATHER])
    assert "".join(p.text for p in pieces) == render(messages, [WEATHER])
    from openk2.data.tokenizer import K2_SPECIAL_TOKENS

    assert all(p.text in K2_SPECIAL_TOKENS for p in pieces if p.marker)
    # Client-controlled text is never a marker piece.
    contents = [p.text for p in pieces if not p.marker]
    assert "Checking both." in contents and "weird@id" in contents and '{"city": "Rome"}' in contents
    segments = render_with_mask(messages, [WEATHER])
    assert "".join(text for text, _ in segments) == render(messages, [WEATHER])
    assistant = [text for text, mine in segments if mine]
    assert assistant[0].startswith("Checking both.<|tool_calls_section_begin|>")
    assert assistant[0].endswith("<|tool_calls_section_end|><|im_end|>")
    assert assistant[1] == "Sunny in Paris, rain in Rome.<|im_end|>"
    prompt = "".join(text for text, mine in segments if not mine)
    assert prompt.endswith(GENERATION_PROMPT) and "## Return of" in prompt
    assert all(a[1] != b[1] for a, b in zip(segments, segments[1:], strict=False))


# ---- errors ----


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty"),
        ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
        (["hi"], "must be a dict"),
        ([{"role": "user", "content": 3}], "content must be"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url"),
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}], "without a tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": [call("c", "f", "{}")]}], "only assistant"),
        ([{"role": "assistant", "tool_calls": [call("c", "f", object())]}], "not JSON-serialisable"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}], "no arguments"),
        ([{"role": "assistant", "tool_calls": ["f"]}], "'function' dict"),
        ([{"role": "user", "name": 3, "content": "x"}], "name must be a string"),
    ],
)
def test_bad_input_raises_value_error(messages, match):
    with pytest.raises(ValueError, match=match):
        render(messages)


def test_what_a_server_sent_renders_back():
    """Anything the server answers (malformed calls, an empty name) must be accepted when the client sends it back."""
    sent_back = [{"role": "user", "content": "x"},
                 {"role": "assistant", "content": None,
                  "tool_calls": [call("0", "", '{"a": '), call("functions.f:1", "f", "[1]")]},
                 {"role": "tool", "tool_call_id": "0", "content": "error"}]
    assert "<|tool_call_begin|>0<|tool_call_argument_begin|>{\"a\": <|tool_call_end|>" in render(sent_back)


def test_bad_tools_and_template_raise_value_error():
    with pytest.raises(ValueError, match="tools"):
        render([{"role": "user", "content": "x"}], tools=["get_weather"])
    with pytest.raises(ValueError, match="unknown chat template"):
        render([{"role": "user", "content": "x"}], template="chatml")


# ---- parsing the assistant's output ----


def test_parse_content_and_calls():
    text = (
        "Checking.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"tz": "CET"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
    )
    content, calls = parse_assistant(text)
    assert content == "Checking."
    assert calls == [call("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
                     call("functions.get_time:1", "get_time", '{"tz": "CET"}')]
    assert parse_assistant("It is sunny.<|im_end|>") == ("It is sunny.", [])


def test_render_parse_round_trip():
    messages = weather_round("functions.get_weather:0", "functions.get_weather:1")[:2]
    messages[1]["content"] = "Let me look.\n"
    messages[1]["tool_calls"][1]["function"]["arguments"] = '{"city": "Rome"}'
    text = render(messages, add_generation_prompt=False)
    body = text[text.rindex(GENERATION_PROMPT) + len(GENERATION_PROMPT):]
    content, calls = parse_assistant(body)
    assert content == "Let me look.\n" and calls == messages[1]["tool_calls"]
    assert render([messages[0], {"role": "assistant", "content": content, "tool_calls": calls}], None, False) == text
    assert all(json.loads(c["function"]["arguments"]) for c in calls)
