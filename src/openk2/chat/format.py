"""`ChatFormat`: a chat request into engine input, and engine output back into an assistant message.

This is the one place where `tool_choice` becomes a forced assistant-turn prefix and stop tokens, and where
a finished sample loses its closing stop token and is parsed into content and tool calls. The server (plain
and streaming), `LocalChatModel`, the SFT tool-call evaluation and RL rollouts all go through it, and the
tool-call format is whatever the parser registry names (`kimi_k2` by default):

    tool_choice   prompt                              stop tokens
    None, "auto"  render(messages, tools)             <|im_end|>
    "none"        render(messages)  (tools hidden)    <|im_end|>, the format's section-begin token
    "required"    render(...) + forced_prefix(None)   <|im_end|>
    {function}    render(...) + forced_prefix(name)   <|im_end|>

The tokenizer is anything with `encode(text, allow_special=...)`, `decode(ids)` and `special_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from openk2.chat.template import IM_END, render
from openk2.chat.tool_parsers import ToolParser, get_tool_parser


class ChatFormatError(ValueError):
    """A request the format cannot render; `param` names the offending request field (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class GenerationLike(Protocol):
    """What `finish` reads of an engine result (`openk2.infer.engine.GenerationResult` has it)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_reason: int | str | None
    text: str | None


@dataclass(frozen=True)
class PreparedPrompt:
    """Engine input for one conversation."""

    token_ids: list[int]
    prefix: str  # text forced at the start of the assistant turn; it belongs to the reply, not the prompt
    stop_token_ids: tuple[int, ...]


@dataclass
class AssistantMessage:
    """A parsed reply: content (None when empty and calls exist), OpenAI-shaped tool calls, finish reason."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"

    def to_openai(self) -> dict:
        """The message as an OpenAI chat message dict."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


class ChatFormat:
    """K2's chat template with a registered tool-call parser, bound to a tokenizer."""

    def __init__(self, tokenizer: Any, tool_parser: str = "kimi_k2") -> None:
        self.tokenizer = tokenizer
        self.parser_cls: type[ToolParser] = get_tool_parser(tool_parser)
        special = tokenizer.special_ids
        self.end_of_turn_id = special[IM_END]
        self.section_begin_id = special[self.parser_cls.section_begin]

    # ------------------------------------------------------------------ request -> engine input
    def prepare(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                tool_choice: str | dict | None = None) -> PreparedPrompt:
        """Prompt token ids, forced prefix and stop token ids; ChatFormatError names the bad field."""
        tools = list(tools) if tools else None
        prefix, stop_ids = "", [self.end_of_turn_id]
        if tool_choice not in (None, "auto", "none") and not tools:
            raise ChatFormatError("tool_choice needs tools", param="tool_choice")
        if tool_choice == "none":
            tools = None  # not declared; a call the model starts anyway ends the sample (stop token)
            stop_ids.append(self.section_begin_id)
        elif tool_choice == "required":
            prefix = self.parser_cls.forced_prefix(None)
        elif tool_choice not in (None, "auto"):
            name = _named_choice(tool_choice)
            if name not in {_tool_name(t) for t in tools}:
                raise ChatFormatError(f"tool_choice names function {name!r}, which is not in tools",
                                      param="tool_choice")
            prefix = self.parser_cls.forced_prefix(name)
        try:
            text = render(messages, tools=tools, add_generation_prompt=True)
        except ValueError as err:
            raise ChatFormatError(str(err), param="messages") from err
        ids = self.tokenizer.encode(text + prefix, allow_special=True)
        return PreparedPrompt(ids, prefix, tuple(stop_ids))

    # ------------------------------------------------------------------ engine output -> message
    def completion_tokens(self, result: GenerationLike) -> tuple[list[int], list[float]]:
        """The generated ids and logprobs without a closing stop token (<|im_end|>, eos, ...)."""
        ids, logprobs = list(result.token_ids), list(result.logprobs)
        if result.finish_reason == "stop" and isinstance(result.stop_reason, int) and ids:
            ids, logprobs = ids[:-1], logprobs[:-1]
        return ids, logprobs

    def completion_text(self, result: GenerationLike) -> str:
        """The generated text, cut before the stop token or stop string that ended it."""
        if isinstance(result.stop_reason, str) and result.text is not None:
            return result.text  # the engine already cut it before the stop string
        return self.tokenizer.decode(self.completion_tokens(result)[0])

    def finish(self, result: GenerationLike, prefix: str = "") -> AssistantMessage:
        """The assistant message a finished sample wrote (after the forced `prefix` of its prompt)."""
        parsed = self.parser_cls().parse(prefix + self.completion_text(result))
        # Malformed calls stay (a client sees what the model tried); their parser error is not OpenAI's shape.
        calls = [{k: v for k, v in c.to_openai().items() if k != "error"} for c in parsed.tool_calls]
        content = parsed.content if parsed.content or not calls else None
        return AssistantMessage(content, calls, "tool_calls" if calls else result.finish_reason)

    def stream_parser(self) -> ToolParser:
        """A fresh incremental parser of this format (for streaming)."""
        return self.parser_cls()


def _named_choice(choice: object) -> str:
    """The function name of a `{"type": "function", "function": {"name": ...}}` tool_choice."""
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ChatFormatError(f"bad tool_choice {choice!r}: expected 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    return name


def _tool_name(tool: object) -> object:
    """A tool spec's function name (None when the spec has none)."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    return fn.get("name") if isinstance(fn, dict) else None
