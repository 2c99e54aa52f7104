"""Reasoning parsers: streaming over random splits equals parsing whole, plus K2-Thinking's rules."""

import random
import sys

import pytest

from openk2.chat import ChatFormat
from openk2.chat.reasoning_parsers import ReasoningDelta, get_reasoning_parser, list_reasoning_parsers
from openk2.data.tokenizer import train_tokenizer
from tests.chat.test_tool_parsers import random_split

SECTION = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"q": "<think>x"}'
           "<|tool_call_end|><|tool_calls_section_end|>")
SAMPLES: dict[str, list[str]] = {
    "kimi_k2": [
        "",
        "<think>Plan it.</think>The answer.",
        "No opening tag, still reasoning.</think>Content.",
        "<think>never closed",
        "<thin",
        "<think>Call it.</think>" + SECTION + " After.",
        "<think>implicit end" + SECTION,
        "<think>a</think>b<think>c</think>d<think>e",
        " <think>leading space is reasoning text</think>x",
        "<think></think></think>",
    ],
}


def stream(cls, pieces: list[str]) -> ReasoningDelta:
    parser, out = cls(), ReasoningDelta()
    for piece in [*pieces, None]:
        delta = parser.finish() if piece is None else parser.feed(piece)
        out.reasoning += delta.reasoning
        out.content += delta.content
    return out


def test_every_registered_reasoning_parser_is_tested():
    module = sys.modules[__name__]
    for name in list_reasoning_parsers():
        assert SAMPLES.get(name), f"reasoning parser {name!r} has no samples"
        assert [t for t in dir(module) if t.startswith(f"test_{name}_")], f"{name!r} has no test_{name}_* tests"


@pytest.mark.parametrize(("name", "text"), [(n, t) for n in list_reasoning_parsers() for t in SAMPLES[n]])
def test_streaming_over_random_splits_equals_parse(name, text):
    cls = get_reasoning_parser(name)
    expected = cls().parse(text)
    assert stream(cls, list(text)) == expected
    rng = random.Random(f"{name}:{text}")
    for _ in range(30):
        assert stream(cls, random_split(text, rng)) == expected


def test_unknown_reasoning_parser():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")


def split(text: str) -> tuple[str, str]:
    result = get_reasoning_parser("kimi_k2")().parse(text)
    return result.reasoning, result.content


def test_kimi_k2_reasoning_then_content():
    assert split("<think>Plan it.</think>The answer.") == ("Plan it.", "The answer.")
    assert split("No opening tag.</think>Content.") == ("No opening tag.", "Content.")
    assert split("<think>never closed") == ("never closed", "")  # still reasoning, as vLLM's kimi_k2


def test_kimi_k2_a_call_section_ends_reasoning_and_keeps_its_text():
    reasoning, content = split("<think>implicit end" + SECTION)
    assert reasoning == "implicit end" and content == SECTION  # "<think>" inside arguments stays


def test_kimi_k2_interleaved_blocks():
    assert split("<think>a</think>b<think>c</think>d<think>e") == ("ace", "bd")
    assert split("<think>Call.</think>" + SECTION + "<think>more</think> After.") == ("Call.more",
                                                                                     SECTION + " After.")


def test_kimi_k2_format_returns_reasoning_content():
    tok = train_tokenizer(["think answer call"] * 10, 600)
    fmt = ChatFormat(tok, reasoning_parser="kimi_k2")
    assert fmt.template == "kimi_k2_thinking"

    class Result:
        finish_reason, stop_reason, text, logprobs = "stop", None, None, []  # ended by its stop token
        token_ids = tok.encode("<think>Use the tool.</think>" + SECTION, allow_special=True)

    reply = fmt.finish(Result())
    assert reply.reasoning_content == "Use the tool." and reply.content is None
    assert reply.finish_reason == "tool_calls" and reply.tool_calls[0]["function"]["arguments"] == '{"q": "<think>x"}'
    stream = fmt.reply_stream()
    deltas = [stream.feed(p) for p in ("<think>Use", " the tool.</th", "ink>Done.")] + [stream.finish()]
    assert "".join(d.reasoning for d in deltas) == "Use the tool." and "".join(d.content for d in deltas) == "Done."
    assert ChatFormat(tok).finish(Result()).reasoning_content is None  # no parser: no reasoning split
