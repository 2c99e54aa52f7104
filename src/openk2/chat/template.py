"""Kimi K2's chat templates: OpenAI-style messages (and tools) in, prompt pieces (or text) out.

`kimi_k2` is the layout of the `chat_template.jinja` shipped with moonshotai/Kimi-K2-Instruct-0905, as
Hugging Face's jinja renders it (trim_blocks, lstrip_blocks; K2's tokenizer deep-sorts the tools first).
Drawn on several lines here; nothing separates the turns on the wire:

    <|im_system|>tool_declare<|im_middle|>\\n  # Tools\\n  [{"function": {...}, "type": "function"}]<|im_end|>
    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
                                                              (only if the first message is not a system one)
    <|im_user|>user<|im_middle|>What's the weather in Paris?<|im_end|>
    <|im_assistant|>assistant<|im_middle|>Checking.<|tool_calls_section_begin|><|tool_call_begin|>call_1
        <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>
    <|im_system|>tool<|im_middle|>## Return of call_1\\n    {"weather": "Sunny"}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>                                  (add_generation_prompt=True)

The name after a role token is the message's `name` if set, else its role (`developer` and `tool` turns
open with `<|im_system|>`). Ids are rendered verbatim. Without a generation prompt the last message has no
`<|im_end|>` (a prefill the model continues). `kimi_k2_thinking` (K2-Thinking's layout) lives in
`template_thinking`; docs/chat-format.md lists both byte by byte.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from openk2.chat import template_thinking
from openk2.chat.pieces import (
    DEFAULT_SYSTEM_PROMPT,
    IM_ASSISTANT,
    IM_MIDDLE,
    IM_SYSTEM,
    IM_USER,
    MISSING,
    Piece,
    check_content,
    check_messages,
    check_tools,
    default_system,
    generation_prompt,
    header,
    jinja_str,
    marker,
    mask_segments,
    parts_text,
    sort_keys,
    text,
    tojson,
    tool_calls,
)
from openk2.chat.tool_parsers import get_tool_parser
from openk2.chat.tool_parsers.kimi_k2 import CALL_ID, FUNCTION_NAME, IM_END, format_call_id

__all__ = [
    "DEFAULT_SYSTEM_PROMPT", "GENERATION_PROMPT", "IM_ASSISTANT", "IM_END", "IM_MIDDLE", "IM_SYSTEM", "IM_USER",
    "TEMPLATES", "Segment", "default_system", "normalize_call_ids", "parse_assistant", "render", "render_pieces",
    "render_with_mask", "tools_json",
]

GENERATION_PROMPT = f"{IM_ASSISTANT}assistant{IM_MIDDLE}"
TOOLS_HEADER = "\n  # Tools\n  "  # between <|im_middle|> and the tools JSON (the template's own indentation)
TOOL_RESULT_SEPARATOR = "\n    "  # between "## Return of {id}" and the result

Segment = tuple[str, bool]  # (text, produced by the assistant)


def tools_json(tools: Sequence[dict]) -> str:
    """The tools as the template's `tojson` writes them after K2's deep sort: keys sorted, ", " and ": "."""
    return tojson(sort_keys(check_tools(tools)), "tools")


def _instruct(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
              call_ids: dict[int, list[str]], result_ids: dict[int, str]) -> list[Piece]:
    """Kimi-K2-Instruct-0905's layout."""
    pieces: list[Piece] = []
    if tools:
        pieces += [marker(IM_SYSTEM), text("tool_declare"), marker(IM_MIDDLE),
                   text(TOOLS_HEADER + tools_json(tools)), marker(IM_END)]
    if messages[0]["role"] != "system":
        pieces += default_system()
    last = len(messages) - 1
    for i, message in enumerate(messages):
        role, content = message["role"], message.get("content", MISSING)
        mine = role == "assistant"
        pieces += header(message)
        if mine and message.get("tool_calls"):
            if content is not MISSING and content:  # any truthy content, via {{ }}: a list of parts as its repr
                pieces.append(text(jinja_str(content), True))
            pieces += tool_calls(message["tool_calls"], i, call_ids.get(i))
        elif role == "tool":
            call_id = result_ids.get(i, message["tool_call_id"])
            pieces.append(text(f"## Return of {call_id}{TOOL_RESULT_SEPARATOR}{jinja_str(content)}"))
        elif isinstance(content, str):
            pieces.append(text(content, mine))
        elif content not in (None, MISSING):
            check_content(content, i)
            pieces.append(text(parts_text(content, i), mine))
        if i < last or add_generation_prompt:
            pieces.append(marker(IM_END, mine))
    if add_generation_prompt:
        pieces += generation_prompt()
    return pieces


# name -> renderer(messages, tools, add_generation_prompt, call_ids, result_ids)
TEMPLATES: dict[str, Callable[..., list[Piece]]] = {
    "kimi_k2": _instruct,
    "kimi_k2_thinking": template_thinking.render_thinking,
}


def render_pieces(messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = True,
                  template: str = "kimi_k2", normalize_ids: bool = False) -> list[Piece]:
    """The prompt as marker/content pieces tagged with who produced them; ValueError on malformed input.

    `normalize_ids` rewrites call ids that are not `functions.NAME:IDX` into that form (and the tool results
    naming them), as the K2 Vendor Verifier advises; off by default, because the real template keeps ids verbatim.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown chat template {template!r}; expected one of {', '.join(sorted(TEMPLATES))}")
    messages = check_messages(messages)
    tools = check_tools(tools) if tools else None
    call_ids, result_ids = normalize_call_ids(messages) if normalize_ids else ({}, {})
    return TEMPLATES[template](messages, tools, add_generation_prompt, call_ids, result_ids)


def render(messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = True,
           template: str = "kimi_k2", normalize_ids: bool = False) -> str:
    """The K2 prompt text for `messages` (and `tools`), byte for byte as the chat template renders it."""
    return "".join(p.text for p in render_pieces(messages, tools, add_generation_prompt, template, normalize_ids))


def render_with_mask(messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = True,
                     template: str = "kimi_k2", normalize_ids: bool = False) -> list[Segment]:
    """`render`'s text as (text, produced by the assistant) segments, for SFT loss masks.

    An assistant turn's header is prompt (False); its content, tool-call section and closing `<|im_end|>`
    are assistant output (True). Neighbouring segments with the same tag are merged.
    """
    return mask_segments(render_pieces(messages, tools, add_generation_prompt, template, normalize_ids))


def normalize_call_ids(messages: list[dict]) -> tuple[dict[int, list[str]], dict[int, str]]:
    """K2-style ids for every call (by message index) and for the tool results answering them (by message index).

    A call whose id is already `functions.NAME:IDX` for its own function keeps it; others get
    `functions.NAME:K`, K counting the calls so far in the conversation and skipping ids already taken.
    A call whose name is not a function name keeps its id. A tool result follows the latest call with its
    id; one naming no call keeps its id.
    """
    call_ids: dict[int, list[str]] = {}
    result_ids: dict[int, str] = {}
    renamed: dict[str, str] = {}
    taken = {c.get("id") for m in messages if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list)
             for c in m["tool_calls"] if isinstance(c, dict)}
    count = 0
    for i, message in enumerate(messages):
        if message["role"] == "tool":
            result_ids[i] = renamed.get(message["tool_call_id"], message["tool_call_id"])
            continue
        if message["role"] != "assistant" or not isinstance(message.get("tool_calls"), list):
            continue
        ids = []
        for call in message["tool_calls"]:
            fn = call.get("function") if isinstance(call, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            source = jinja_str(call.get("id", MISSING)) if isinstance(call, dict) else ""
            match = CALL_ID.fullmatch(source)
            if (match is not None and match.group(1) == name) or not isinstance(name, str) \
                    or not FUNCTION_NAME.fullmatch(name):
                new = source
            else:
                index = count
                while format_call_id(name, index) in taken:
                    index += 1
                new = format_call_id(name, index)
                taken.add(new)
            renamed[source] = new
            ids.append(new)
            count += 1
        call_ids[i] = ids
    return call_ids, result_ids


def parse_assistant(text: str, tool_parser: str = "kimi_k2",
                    tools: Sequence[dict] | None = None) -> tuple[str, list[dict]]:
    """Model output (after the generation prompt) -> content and OpenAI-shaped tool calls.

    Never raises on malformed output: a call whose arguments are not a JSON object is returned with an
    extra "error" key (its "arguments" hold the raw text); a call whose id names no function is resolved from
    the declared `tools` when it can be, else dropped (see `tool_parsers.kimi_k2`).
    """
    result = get_tool_parser(tool_parser)(tools).parse(text)
    return result.content, [call.to_openai() for call in result.tool_calls]
