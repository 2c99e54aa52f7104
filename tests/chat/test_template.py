"""K2's chat template: rendering, the assistant mask, errors, and parsing the assistant's output back."""

import json

import pytest

from openk2.chat.template import (
    DEFAULT_SYSTEM_PROMPT,
    GENERATION_PROMPT,
    IM_ASSISTANT,
    IM_MIDDLE,
    IM_SYSTEM,
    IM_USER,
    parse_assistant,
    render,
    render_with_mask,
)
from openk2.chat.tool_parsers.kimi_k2 import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    IM_END,
    SECTION_BEGIN,
    SECTION_END,
)

DEFAULT_SYSTEM = f"{IM_SYSTEM}system{IM_MIDDLE}{DEFAULT_SYSTEM_PROMPT}{IM_END}"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
    },
}


def call(call_id, name, arguments):
    """An OpenAI-shaped tool call."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def two_call_conversation(id0="call_abc", id1="call_def"):
    """User asks, assistant makes two calls with content, both results come back."""
    return [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking both.",
            "tool_calls": [
                call(id0, "get_weather", '{"city": "Paris"}'),
                call(id1, "get_weather", '{"city": "Rome"}'),
            ],
        },
        {"role": "tool", "tool_call_id": id0, "content": '{"weather": "Sunny"}'},
        {"role": "tool", "tool_call_id": id1, "content": '{"weather": "Rain"}'},
    ]


# ---- rendering ----


def test_plain_chat_without_system_gets_the_default_system_prompt():
    text = render([{"role": "user", "content": "Hi"}])
    assert text == (
        f"{IM_SYSTEM}system{IM_MIDDLE}You are Kimi, an AI assistant created by Moonshot AI.{IM_END}"
        f"{IM_USER}user{IM_MIDDLE}Hi{IM_END}"
        f"{IM_ASSISTANT}assistant{IM_MIDDLE}"
    )


def test_plain_chat_with_system_prompt_and_history():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    assert render(messages, add_generation_prompt=False) == (
        f"{IM_SYSTEM}system{IM_MIDDLE}Be brief.{IM_END}"
        f"{IM_USER}user{IM_MIDDLE}Hi{IM_END}"
        f"{IM_ASSISTANT}assistant{IM_MIDDLE}Hello!{IM_END}"
        f"{IM_USER}user{IM_MIDDLE}2+2?{IM_END}"
    )
    assert DEFAULT_SYSTEM_PROMPT not in render(messages)


def test_generation_prompt_is_the_open_assistant_turn():
    messages = [{"role": "user", "content": "Hi"}]
    assert render(messages).endswith(GENERATION_PROMPT)
    assert GENERATION_PROMPT == "<|im_assistant|>assistant<|im_middle|>"
    assert render(messages, add_generation_prompt=False).endswith(f"Hi{IM_END}")


def test_explicit_name_replaces_the_role_name():
    text = render([{"role": "user", "name": "alice", "content": "Hi"}], add_generation_prompt=False)
    assert text.endswith(f"{IM_USER}alice{IM_MIDDLE}Hi{IM_END}")


def test_content_parts_are_joined_without_separator():
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    assert f"{IM_MIDDLE}Hello, world{IM_END}" in render([{"role": "user", "content": parts}])


def test_tools_are_declared_first_as_compact_sorted_json():
    text = render([{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL])
    declared = (
        f"{IM_SYSTEM}tool_declare{IM_MIDDLE}"
        '[{"function":{"description":"Weather in a city","name":"get_weather",'
        '"parameters":{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}},'
        f'"type":"function"}}]{IM_END}'
    )
    assert text == declared + DEFAULT_SYSTEM + f"{IM_USER}user{IM_MIDDLE}Hi{IM_END}" + GENERATION_PROMPT
    # The declaration does not depend on the key order the client sent.
    shuffled = {"function": dict(reversed(list(WEATHER_TOOL["function"].items()))), "type": "function"}
    assert render([{"role": "user", "content": "Hi"}], tools=[shuffled]) == text
    # Non-ASCII stays as is, as the template's tojson writes it.
    tool = {"type": "function", "function": {"name": "f", "description": "météo"}}
    assert "météo" in render([{"role": "user", "content": "Hi"}], tools=[tool])


def test_no_tool_declaration_without_tools():
    assert "tool_declare" not in render([{"role": "user", "content": "Hi"}], tools=[])


def test_assistant_with_content_and_two_tool_calls_keeps_k2_ids():
    messages = two_call_conversation("functions.get_weather:0", "functions.get_weather:1")[:2]
    assert render(messages, add_generation_prompt=False).endswith(
        f"{IM_ASSISTANT}assistant{IM_MIDDLE}Checking both."
        f"{SECTION_BEGIN}"
        f'{CALL_BEGIN}functions.get_weather:0{ARGUMENT_BEGIN}{{"city": "Paris"}}{CALL_END}'
        f'{CALL_BEGIN}functions.get_weather:1{ARGUMENT_BEGIN}{{"city": "Rome"}}{CALL_END}'
        f"{SECTION_END}{IM_END}"
    )


def test_tool_results_render_as_system_turns_naming_the_call():
    text = render(two_call_conversation("functions.get_weather:0", "functions.get_weather:1"))
    assert text.endswith(
        f"{IM_SYSTEM}tool{IM_MIDDLE}## Return of functions.get_weather:0\n"
        f'{{"weather": "Sunny"}}{IM_END}'
        f"{IM_SYSTEM}tool{IM_MIDDLE}## Return of functions.get_weather:1\n"
        f'{{"weather": "Rain"}}{IM_END}' + GENERATION_PROMPT
    )


def test_tool_result_with_name_uses_it_after_the_role_token():
    messages = two_call_conversation()[:3]
    messages[2]["name"] = "get_weather"
    assert f"{IM_SYSTEM}get_weather{IM_MIDDLE}## Return of functions.get_weather:0\n" in render(messages)


def test_foreign_ids_become_k2_ids_counted_over_the_conversation():
    messages = two_call_conversation("call_abc", "call_def")
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call("call_xyz", "get_time", "{}")]},
        {"role": "tool", "tool_call_id": "call_xyz", "content": "noon"},
    ]
    text = render(messages)
    for k2_id in ("functions.get_weather:0", "functions.get_weather:1", "functions.get_time:2"):
        assert f"{CALL_BEGIN}{k2_id}{ARGUMENT_BEGIN}" in text
        assert f"## Return of {k2_id}\n" in text
    assert not any(f"call_{x}" in text for x in ("abc", "def", "xyz"))


def test_generated_ids_skip_ones_already_taken():
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [call("functions.f:1", "f", "{}"), call("call_q", "f", "{}")]},
        {"role": "tool", "tool_call_id": "call_q", "content": "ok"},
    ]
    text = render(messages)
    assert f"{CALL_BEGIN}functions.f:2{ARGUMENT_BEGIN}" in text  # :1 is taken by the first call
    assert "## Return of functions.f:2\n" in text


def test_dict_arguments_are_serialized():
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call("c", "f", {"a": 1})]}]
    assert f'{ARGUMENT_BEGIN}{{"a": 1}}{CALL_END}' in render(messages)


# ---- the assistant mask ----


def test_mask_tags_exactly_the_assistant_output():
    messages = two_call_conversation() + [{"role": "assistant", "content": "Sunny in Paris, rain in Rome."}]
    segments = render_with_mask(messages, tools=[WEATHER_TOOL])
    assert "".join(text for text, _ in segments) == render(messages, tools=[WEATHER_TOOL])
    assistant = [text for text, is_assistant in segments if is_assistant]
    assert len(assistant) == 2
    assert assistant[0].startswith("Checking both." + SECTION_BEGIN)
    assert assistant[0].endswith(SECTION_END + IM_END)
    assert assistant[1] == "Sunny in Paris, rain in Rome." + IM_END
    # Headers, tool results and the generation prompt are prompt, and tags alternate after merging.
    prompt = "".join(text for text, is_assistant in segments if not is_assistant)
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
        ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c1", "content": "r"}], "matches no"),
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}], "without a tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": [call("c", "f", "{}")]}], "only assistant"),
        ([{"role": "assistant", "tool_calls": [call("c", "f", "{not json")]}], "not valid JSON"),
        ([{"role": "assistant", "tool_calls": [call("c", "f", "[1, 2]")]}], "JSON object"),
        ([{"role": "assistant", "tool_calls": [call("c", "f", 5)]}], "JSON string"),
        ([{"role": "assistant", "tool_calls": [call("c", "bad name", "{}")]}], "function.name"),
        ([{"role": "assistant", "tool_calls": [call("functions.g:0", "f", "{}")]}], "names function 'g'"),
        ([{"role": "assistant", "tool_calls": [call("c", "f", "{}"), call("c", "f", "{}")]}], "repeats id"),
        ([{"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}], "type 'code'"),
    ],
)
def test_bad_input_raises_value_error(messages, match):
    with pytest.raises(ValueError, match=match):
        render(messages)


def test_a_tool_result_cannot_answer_a_later_call():
    messages = two_call_conversation()
    messages.insert(1, {"role": "tool", "tool_call_id": "call_abc", "content": "too early"})
    with pytest.raises(ValueError, match="matches no earlier"):
        render(messages)


def test_bad_tools_raise_value_error():
    with pytest.raises(ValueError, match="tools"):
        render([{"role": "user", "content": "x"}], tools=["get_weather"])


# ---- parsing the assistant's output ----


def test_parse_plain_answer():
    assert parse_assistant("It is sunny.<|im_end|>") == ("It is sunny.", [])
    assert parse_assistant("No end token") == ("No end token", [])


def test_parse_content_and_calls():
    text = (
        "Checking.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"tz": "CET"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
    )
    content, calls = parse_assistant(text)
    assert content == "Checking."
    assert calls == [
        call("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
        call("functions.get_time:1", "get_time", '{"tz": "CET"}'),
    ]


def test_parse_tolerates_whitespace_and_dotted_names():
    text = (
        "<|tool_calls_section_begin|>\n  <|tool_call_begin|> functions.get_weather.v2:3 \n"
        '<|tool_call_argument_begin|>\n {"city": "Oslo"} \n<|tool_call_end|>\n'
        "<|tool_call_begin|>functions.search-web_2:4<|tool_call_argument_begin|>{}<|tool_call_end|>\n"
        "<|tool_calls_section_end|>\n"
    )
    content, calls = parse_assistant(text)
    assert content == ""
    assert calls == [
        call("functions.get_weather.v2:3", "get_weather.v2", '{"city": "Oslo"}'),
        call("functions.search-web_2:4", "search-web_2", "{}"),
    ]


def test_parse_reports_malformed_arguments_without_raising():
    text = (
        "<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": <|tool_call_end|>'
        '<|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{"b": 2}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
    )
    _, calls = parse_assistant(text)
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a":'}
    assert "not valid JSON" in calls[0]["error"]
    assert calls[1] == call("functions.g:1", "g", '{"b": 2}')


def test_parse_output_cut_off_mid_call():
    _, calls = parse_assistant(
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a"'
    )
    assert calls[0]["id"] == "functions.f:0" and "not valid JSON" in calls[0]["error"]


def test_render_parse_round_trip():
    messages = two_call_conversation("call_1", "call_2")
    messages[1]["content"] = "Let me look.\n"
    text = render(messages[:2], add_generation_prompt=False)
    body = text[text.rindex(GENERATION_PROMPT) + len(GENERATION_PROMPT) :]
    content, calls = parse_assistant(body)
    assert content == "Let me look.\n"
    assert calls == [
        call("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
        call("functions.get_weather:1", "get_weather", '{"city": "Rome"}'),
    ]
    # Parsed calls go straight back into a conversation and render to the same text.
    assert render([messages[0], {"role": "assistant", "content": content, "tool_calls": calls}], None, False) == text
    assert all(json.loads(c["function"]["arguments"]) for c in calls)


def test_markers_are_k2_special_tokens():
    from openk2.data.tokenizer import K2_SPECIAL_TOKENS

    markers = (IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END, SECTION_BEGIN, SECTION_END)
    assert set(markers + (CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)) <= set(K2_SPECIAL_TOKENS)
