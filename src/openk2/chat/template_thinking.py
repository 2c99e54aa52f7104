"""K2-Thinking's chat template (`kimi_k2_thinking`): the Instruct layout plus reasoning, as HF's jinja renders it.

Checked against the K2-Thinking template as public copies carry it (llama.cpp's
`models/templates/moonshotai-Kimi-K2-Thinking.jinja`). Where it differs from `kimi_k2`:

- tools: `<|im_system|>tool_declare<|im_middle|>` + the sorted tools as JSON (no `# Tools` header);
- every assistant turn opens with `<think>...</think>`: the messages up to and including the last assistant
  message without tool calls are history and keep an empty `<think></think>` (earlier turns' reasoning is
  dropped); the messages after it (the agentic loop in progress) keep their `reasoning_content`;
- content in parts is joined in every role (no Python repr), and a tool result is `## Return of {id}\\n{content}`;
- every message ends with `<|im_end|>`, also the last one without a generation prompt.

`<think>` and `</think>` are text here (the released K2 tokenizer has no special ids for them).
"""

from __future__ import annotations

from openk2.chat.pieces import (
    IM_MIDDLE,
    IM_SYSTEM,
    MISSING,
    Piece,
    check_content,
    default_system,
    generation_prompt,
    header,
    jinja_str,
    marker,
    parts_text,
    sort_keys,
    text,
    tojson,
    tool_calls,
)
from openk2.chat.tool_parsers.kimi_k2 import IM_END

THINK_START, THINK_END = "<think>", "</think>"


def _content(message: dict, i: int) -> str:
    """The template's render_content: a string as is, parts' text joined, nothing for None."""
    content = message.get("content")
    check_content(content, i)
    return parts_text(content, i) if isinstance(content, list) else content or ""


def render_thinking(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                    call_ids: dict[int, list[str]], result_ids: dict[int, str]) -> list[Piece]:
    """K2-Thinking's layout (see the module docstring)."""
    history_end = next((i for i in range(len(messages) - 1, -1, -1)
                        if messages[i]["role"] == "assistant" and not messages[i].get("tool_calls")), -1)
    pieces: list[Piece] = []
    if tools:
        pieces += [marker(IM_SYSTEM), text("tool_declare"), marker(IM_MIDDLE), text(tojson(sort_keys(tools), "tools")),
                   marker(IM_END)]
    if messages[0]["role"] != "system":
        pieces += default_system()
    for i, message in enumerate(messages):
        role = message["role"]
        mine = role == "assistant"
        pieces += header(message)
        if mine:
            reasoning = jinja_str(message.get("reasoning_content", "")) if i > history_end else ""
            pieces.append(text(f"{THINK_START}{reasoning}{THINK_END}{_content(message, i)}", True))
            if message.get("tool_calls"):
                pieces += tool_calls(message["tool_calls"], i, call_ids.get(i))
        elif role == "tool":
            call_id = result_ids.get(i, message["tool_call_id"])
            pieces.append(text(f"## Return of {call_id}\n{_content(message, i)}"))
        elif message.get("content", MISSING) not in (None, MISSING):
            pieces.append(text(_content(message, i)))
        pieces.append(marker(IM_END, mine))
    if add_generation_prompt:
        pieces += generation_prompt()
    return pieces
