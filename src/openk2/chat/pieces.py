"""The building blocks of a rendered K2 prompt: pieces tagged as template marker or content, and as assistant output.

A chat template here renders to a list of `Piece`s rather than to one string, so that the two facts the
string loses survive: which characters are the template's own control markers (`<|im_end|>` ...; encoded as
their special-token ids) and which are content (message text, names, ids, arguments, tool results; encoded
as plain text even when they spell a special token), and which characters the assistant produced (the SFT
loss mask). Joined, the pieces are exactly the text the real template renders.

Also here: the value rules of Hugging Face's jinja rendering that the K2 templates rely on (`jinja_str`,
`tojson`), shared by every template module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from openk2.chat.tool_parsers.kimi_k2 import ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, IM_END, SECTION_BEGIN, SECTION_END

IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
ROLES = ("system", "developer", "user", "assistant", "tool")
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
MISSING = object()  # a key the message does not have (jinja: Undefined, renders as "")


@dataclass(frozen=True)
class Piece:
    """A run of rendered text: a template `marker` (one special token) or content, produced by the assistant or not."""

    text: str
    assistant: bool = False
    marker: bool = False


def marker(text: str, assistant: bool = False) -> Piece:
    """A template marker piece."""
    return Piece(text, assistant, True)


def text(value: str, assistant: bool = False) -> Piece:
    """A content piece."""
    return Piece(value, assistant, False)


def jinja_str(value: object) -> str:
    """`{{ value }}` as HF's jinja renders it: str() of the value, "" for a missing key (None gives "None")."""
    return "" if value is MISSING else str(value)


def tojson(value: object, where: str) -> str:
    """HF's `tojson` filter: json.dumps with the default separators and non-ASCII kept; ValueError if not JSON."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where} is not JSON-serialisable: {err}") from None


def sort_keys(value: object) -> object:
    """`value` with every dict's keys sorted, recursively (K2's tokenizer deep-sorts the tools before rendering)."""
    if isinstance(value, dict):
        return {k: sort_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [sort_keys(v) for v in value]
    return value


def check_tools(tools: object) -> list[dict]:
    """The tools as a list of dicts; ValueError otherwise."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of dicts, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}] must be a dict, got {type(tool).__name__}")
    return list(tools)


def check_messages(messages: object) -> list[dict]:
    """The messages as a non-empty list of dicts with known roles; ValueError otherwise."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}] has unknown role {role!r}; expected one of {', '.join(ROLES)}")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"messages[{i}].name must be a string, got {type(name).__name__}")
        if message.get("tool_calls") and role != "assistant":
            raise ValueError(f"messages[{i}] has tool_calls but role {role!r}; only assistant messages make calls")
        if role == "tool" and not isinstance(message.get("tool_call_id"), str):
            raise ValueError(f"messages[{i}] is a tool result without a tool_call_id string")
    return list(messages)


def header(message: dict) -> list[Piece]:
    """`<|im_user|>` / `<|im_assistant|>` / `<|im_system|>` (every other role), the name or role, `<|im_middle|>`."""
    role = message["role"]
    token = IM_USER if role == "user" else IM_ASSISTANT if role == "assistant" else IM_SYSTEM
    return [marker(token), text(message.get("name") or role), marker(IM_MIDDLE)]


def default_system() -> list[Piece]:
    """The system turn the templates insert when the conversation does not open with one."""
    return [marker(IM_SYSTEM), text("system"), marker(IM_MIDDLE), text(DEFAULT_SYSTEM_PROMPT), marker(IM_END)]


def generation_prompt() -> list[Piece]:
    """The open assistant turn the model continues."""
    return [marker(IM_ASSISTANT), text("assistant"), marker(IM_MIDDLE)]


def parts_text(content: list, i: int) -> str:
    """A list of content parts as the templates render it: the text parts joined with nothing between."""
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            # K2-Instruct reads text only; its template's image placeholder has no encoder behind it here.
            raise ValueError(f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}}, got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def check_content(content: object, i: int) -> None:
    """ValueError unless content is None, a string or a list of text parts."""
    if content is not None and not isinstance(content, (str, list)):
        raise ValueError(f"messages[{i}].content must be a string or a list of parts, got {type(content).__name__}")
    if isinstance(content, list):
        parts_text(content, i)


def tool_calls(calls: object, i: int, ids: Sequence[str] | None = None, assistant: bool = True) -> list[Piece]:
    """An assistant message's calls as one section; each id verbatim (or `ids[j]` when given)."""
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list, got {type(calls).__name__}")
    pieces = [marker(SECTION_BEGIN, assistant)]
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise ValueError(f"{where} must be a dict with a 'function' dict")
        arguments = call["function"].get("arguments", MISSING)
        if arguments is MISSING:
            raise ValueError(f"{where}.function has no arguments")
        args = arguments if isinstance(arguments, str) else tojson(arguments, f"{where}.function.arguments")
        call_id = ids[j] if ids is not None else jinja_str(call.get("id", MISSING))
        pieces += [marker(CALL_BEGIN, assistant), text(call_id, assistant), marker(ARGUMENT_BEGIN, assistant),
                   text(args, assistant), marker(CALL_END, assistant)]
    pieces.append(marker(SECTION_END, assistant))
    return pieces


def mask_segments(pieces: Sequence[Piece]) -> list[tuple[str, bool]]:
    """(text, produced by the assistant) runs of `pieces`, neighbours with the same tag merged, empty ones dropped."""
    merged: list[tuple[str, bool]] = []
    for piece in pieces:
        if not piece.text:
            continue
        if merged and merged[-1][1] == piece.assistant:
            merged[-1] = (merged[-1][0] + piece.text, piece.assistant)
        else:
            merged.append((piece.text, piece.assistant))
    return merged
