"""Kimi K2's chat template: OpenAI-style messages (and tools) in, prompt text out; model output back to messages.

The layout follows the `chat_template.jinja` of moonshotai/Kimi-K2-Instruct (see docs/chat-format.md):

    <|im_system|>tool_declare<|im_middle|>[{...tools, compact JSON...}]<|im_end|>      (only with tools)
    <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
                                                                            (only if no system message leads)
    <|im_user|>user<|im_middle|>What's the weather in Paris?<|im_end|>
    <|im_assistant|>assistant<|im_middle|>Checking.<|tool_calls_section_begin|><|tool_call_begin|>
        functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
        <|tool_calls_section_end|><|im_end|>
    <|im_system|>tool<|im_middle|>## Return of functions.get_weather:0
    {"weather": "Sunny"}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>                                  (add_generation_prompt=True)

with no newlines between turns (they are drawn here only to fit). The name after a role token is the
message's `name` if given, else its role.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from openk2.chat.tool_parsers import get_tool_parser
from openk2.chat.tool_parsers.kimi_k2 import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    CALL_ID,
    FUNCTION_NAME,
    IM_END,
    SECTION_BEGIN,
    SECTION_END,
    check_arguments,
    format_call_id,
)

IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
GENERATION_PROMPT = f"{IM_ASSISTANT}assistant{IM_MIDDLE}"
TOOL_RESULT_HEADER = "## Return of {call_id}\n"
ROLE_TOKENS = {"system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT, "tool": IM_SYSTEM}

Segment = tuple[str, bool]  # (text, produced by the assistant)


def render(messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = True) -> str:
    """The K2 prompt text for `messages` (and `tools`), as the chat template renders it."""
    return "".join(text for text, _ in render_with_mask(messages, tools, add_generation_prompt))


def render_with_mask(
    messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = True
) -> list[Segment]:
    """`render`'s text as segments tagged True where the assistant produced it (for loss masks in SFT).

    An assistant turn's header is prompt (False); its content, tool-call section and closing `<|im_end|>`
    are assistant output (True). Neighbouring segments with the same tag are merged.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of dicts")
    segments: list[Segment] = []
    if tools:
        segments.append((f"{IM_SYSTEM}tool_declare{IM_MIDDLE}{tools_json(tools)}{IM_END}", False))
    if _role(messages[0], 0) != "system":
        segments.append((f"{IM_SYSTEM}system{IM_MIDDLE}{DEFAULT_SYSTEM_PROMPT}{IM_END}", False))
    ids = _CallIds()
    for i, message in enumerate(messages):
        segments.extend(_render_message(message, i, ids))
    if add_generation_prompt:
        segments.append((GENERATION_PROMPT, False))
    return _merge(segments)


def parse_assistant(text: str, tool_parser: str = "kimi_k2") -> tuple[str, list[dict]]:
    """Model output (after the generation prompt) -> content and OpenAI-shaped tool calls.

    Never raises on malformed output: a call whose arguments are not a JSON object, or whose id names
    no function, is returned with an extra "error" key (its "arguments" hold the raw text).
    """
    result = get_tool_parser(tool_parser)().parse(text)
    return result.content, [call.to_openai() for call in result.tool_calls]


def tools_json(tools: Sequence[dict]) -> str:
    """The tool_declare payload: keys sorted at every depth, compact separators, non-ASCII kept."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of dicts, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}] must be a dict, got {type(tool).__name__}")
    # Sorting matches K2's tokenizer (its apply_chat_template deep-sorts the tools) and keeps the prompt,
    # hence the KV-cache prefix, independent of the key order a client happened to send.
    return json.dumps(_sort_keys(list(tools)), ensure_ascii=False, separators=(",", ":"))


def _sort_keys(value: object) -> object:
    """`value` with every dict's keys sorted, recursively."""
    if isinstance(value, dict):
        return {k: _sort_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sort_keys(v) for v in value]
    return value


def _role(message: object, i: int) -> str:
    """The message's role; ValueError if the message is not a dict or the role is unknown."""
    if not isinstance(message, dict):
        raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLE_TOKENS:
        raise ValueError(f"messages[{i}] has unknown role {role!r}; expected one of {', '.join(ROLE_TOKENS)}")
    return role


def _render_message(message: dict, i: int, ids: _CallIds) -> list[Segment]:
    """One message as segments."""
    role = _role(message, i)
    name = message.get("name") or role
    if not isinstance(name, str):
        raise ValueError(f"messages[{i}].name must be a string, got {type(name).__name__}")
    header = f"{ROLE_TOKENS[role]}{name}{IM_MIDDLE}"
    content = _flatten_content(message.get("content"), i)
    tool_calls = message.get("tool_calls")
    if tool_calls and role != "assistant":
        raise ValueError(f"messages[{i}] has tool_calls but role {role!r}; only assistant messages make calls")
    if role == "assistant":
        calls = _render_tool_calls(tool_calls, i, ids) if tool_calls else ""
        return [(header, False), (content + calls + IM_END, True)]
    if role == "tool":
        call_id = ids.resolve(message.get("tool_call_id"), i)
        content = TOOL_RESULT_HEADER.format(call_id=call_id) + content
    return [(header + content + IM_END, False)]


def _flatten_content(content: object, i: int) -> str:
    """A message's content as text: a string as is, a list's text parts joined with nothing between."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content must be a string or a list of parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            # K2-Instruct reads text only; its template's image placeholder has no encoder behind it here.
            raise ValueError(f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}}, got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _render_tool_calls(tool_calls: object, i: int, ids: _CallIds) -> str:
    """An assistant message's calls as one K2 tool-call section."""
    if not isinstance(tool_calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list, got {type(tool_calls).__name__}")
    parts = [SECTION_BEGIN]
    seen: set[str] = set()
    for j, call in enumerate(tool_calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise ValueError(f"{where} must be a dict with a 'function' dict")
        if call.get("type", "function") != "function":
            raise ValueError(f"{where} has type {call.get('type')!r}; only 'function' calls exist in K2's format")
        fn = call["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be letters, digits, '_', '-' or '.', got {name!r}")
        source_id = call.get("id")
        call_id = ids.assign(source_id, name, where)
        # A repeated id would leave its tool results ambiguous.
        if source_id in seen or call_id in seen:
            raise ValueError(f"{where} repeats id {source_id or call_id!r} within one message")
        seen.update(x for x in (source_id, call_id) if x)
        parts.append(f"{CALL_BEGIN}{call_id}{ARGUMENT_BEGIN}{_arguments(fn.get('arguments'), where)}{CALL_END}")
    parts.append(SECTION_END)
    return "".join(parts)


def _arguments(arguments: object, where: str) -> str:
    """Call arguments as text: a JSON-object string verbatim, a dict serialized as the template's tojson does."""
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise ValueError(f"{where}.function.arguments must be a JSON string, got {type(arguments).__name__}")
    error = check_arguments(arguments)
    if error is not None:
        raise ValueError(f"{where}.function.arguments: {error}")
    return arguments


class _CallIds:
    """Gives every call a K2 id and remembers it, so tool results can name the call they answer.

    Ids already of the form `functions.NAME:IDX` (with NAME the call's function) are kept. Others
    (e.g. OpenAI's `call_abc123`) become `functions.NAME:K`, K counting all calls so far in the
    conversation (skipping any K whose id is taken). A tool message's `tool_call_id` may name a call
    by its original id or by its K2 id; a reused id refers to its latest call.
    """

    def __init__(self) -> None:
        self._count = 0
        self._k2_ids: dict[str, str] = {}  # original id or K2 id -> K2 id
        self._used: set[str] = set()

    def assign(self, source_id: object, name: str, where: str) -> str:
        """The K2 id for a call to `name` carrying `source_id` (may be None)."""
        if source_id is not None and not isinstance(source_id, str):
            raise ValueError(f"{where}.id must be a string, got {type(source_id).__name__}")
        match = CALL_ID.fullmatch(source_id or "")
        if match is not None and match.group(1) != name:
            raise ValueError(f"{where}.id {source_id!r} names function {match.group(1)!r}, but the call is to {name!r}")
        if match is not None:
            k2_id = source_id
        else:
            index = self._count
            while format_call_id(name, index) in self._used:
                index += 1
            k2_id = format_call_id(name, index)
        self._count += 1
        self._used.add(k2_id)
        self._k2_ids[k2_id] = k2_id
        if source_id:
            self._k2_ids[source_id] = k2_id
        return k2_id

    def resolve(self, tool_call_id: object, i: int) -> str:
        """The K2 id of the call a tool message answers; ValueError if no earlier call matches."""
        if not isinstance(tool_call_id, str) or not tool_call_id:
            raise ValueError(f"messages[{i}] is a tool result without a tool_call_id")
        if tool_call_id not in self._k2_ids:
            raise ValueError(f"messages[{i}].tool_call_id {tool_call_id!r} matches no earlier assistant tool call")
        return self._k2_ids[tool_call_id]


def _merge(segments: list[Segment]) -> list[Segment]:
    """Join neighbouring segments with the same tag; drop empty ones."""
    merged: list[Segment] = []
    for text, is_assistant in segments:
        if not text:
            continue
        if merged and merged[-1][1] == is_assistant:
            merged[-1] = (merged[-1][0] + text, is_assistant)
        else:
            merged.append((text, is_assistant))
    return merged
