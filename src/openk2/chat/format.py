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

The prompt is rendered to marker/content pieces and encoded with text kept as text (`encoding`): message
content, names, ids, arguments and tool results never become control tokens, whatever they spell. The
template is `kimi_k2` (K2-Instruct) or `kimi_k2_thinking`; with a reasoning parser (`kimi_k2`), the reply's
`<think>...</think>` text becomes `reasoning_content` and only the rest is searched for tool calls.

The tokenizer is anything with `encode(text, allow_special=...)`, `decode(ids)` and `special_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from openk2.chat.encoding import encode_pieces, trusted_pieces
from openk2.chat.reasoning_parsers import ReasoningParser, get_reasoning_parser
from openk2.chat.template import IM_END, TEMPLATES, render_pieces
from openk2.chat.tool_parsers import DeltaMessage, ToolParser, get_tool_parser


def reply_finish_reason(called: bool, engine_reason: str) -> str:
    """OpenAI's finish_reason: `tool_calls` when the reply called, except that a reply cut by max_tokens stays
    `length` (its last call's arguments may be cut too, and a client must be able to tell)."""
    return "tool_calls" if called and engine_reason != "length" else engine_reason


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
    """A parsed reply: content (None when empty and calls exist), OpenAI-shaped tool calls, finish reason,
    and the reasoning (None without a reasoning parser or when there was none)."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"
    reasoning_content: str | None = None
    notes: list[str] = field(default_factory=list)  # why calls were dropped (ids naming no function, ...)

    def to_openai(self) -> dict:
        """The message as an OpenAI chat message dict (`reasoning_content` only when there is some)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


@dataclass
class ReplyDelta:
    """What a streamed reply made certain: reasoning text, content text, tool-call deltas (OpenAI's shape)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # calls dropped, one note each (never announced as deltas)

    def is_empty(self) -> bool:
        """Whether this delta carries nothing."""
        return not (self.reasoning or self.content or self.tool_calls or self.notes)


class ReplyStream:
    """A reply parsed as it streams: the reasoning parser (if any) first, then the tool parser on the content."""

    def __init__(self, tool_parser: ToolParser, reasoning_parser: ReasoningParser | None) -> None:
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser

    def feed(self, text: str) -> ReplyDelta:
        """Consume the next piece of output text."""
        if self.reasoning_parser is None:
            return self._calls("", self.tool_parser.feed(text))
        split = self.reasoning_parser.feed(text)
        return self._calls(split.reasoning, self.tool_parser.feed(split.content))

    def finish(self) -> ReplyDelta:
        """End of output: flush both parsers."""
        reasoning, content = "", ""
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.finish()
            reasoning, content = split.reasoning, split.content
        first = self.tool_parser.feed(content)
        last = self.tool_parser.finish()
        merged = DeltaMessage(first.content + last.content, first.tool_calls + last.tool_calls,
                              dropped=first.dropped + last.dropped)
        return self._calls(reasoning, merged)

    @staticmethod
    def _calls(reasoning: str, delta: DeltaMessage) -> ReplyDelta:
        return ReplyDelta(reasoning, delta.content, list(delta.tool_calls), list(delta.dropped))


class ChatFormat:
    """K2's chat template with registered tool-call (and optional reasoning) parsers, bound to a tokenizer.

    `template` defaults to `kimi_k2_thinking` with a reasoning parser, else `kimi_k2`; `normalize_ids` rewrites
    call ids to `functions.NAME:IDX` (the K2 Vendor Verifier's advice; off: the real template keeps ids verbatim).
    """

    def __init__(self, tokenizer: Any, tool_parser: str = "kimi_k2", reasoning_parser: str | None = None,
                 template: str | None = None, normalize_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.parser_cls: type[ToolParser] = get_tool_parser(tool_parser)
        self.reasoning_cls: type[ReasoningParser] | None = (
            get_reasoning_parser(reasoning_parser) if reasoning_parser else None)
        self.template = template or ("kimi_k2_thinking" if reasoning_parser else "kimi_k2")
        if self.template not in TEMPLATES:
            raise ValueError(f"unknown chat template {self.template!r}; expected one of {', '.join(sorted(TEMPLATES))}")
        self.normalize_ids = normalize_ids
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
            pieces = render_pieces(messages, tools, True, self.template, self.normalize_ids)
        except ValueError as err:
            raise ChatFormatError(str(err), param="messages") from err
        ids, _ = encode_pieces(self.tokenizer, pieces + trusted_pieces(prefix, assistant=True))
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

    def finish(self, result: GenerationLike, prefix: str = "", tools: Sequence[dict] | None = None) -> AssistantMessage:
        """The assistant message a finished sample wrote (after the forced `prefix` of its prompt); `tools`, the
        request's declared tools, resolve calls whose ids name no function (the parser drops them otherwise)."""
        text, reasoning = prefix + self.completion_text(result), None
        if self.reasoning_cls is not None:
            split = self.reasoning_cls().parse(text)
            text, reasoning = split.content, split.reasoning or None
        parsed = self.parser_cls(tools).parse(text)
        # Malformed calls stay (a client sees what the model tried); their parser error is not OpenAI's shape.
        calls = [{k: v for k, v in c.to_openai().items() if k != "error"} for c in parsed.tool_calls]
        content = parsed.content if parsed.content or not (calls or reasoning) else None
        return AssistantMessage(content, calls, reply_finish_reason(bool(calls), result.finish_reason), reasoning,
                                list(parsed.dropped))

    def stream_parser(self, tools: Sequence[dict] | None = None) -> ToolParser:
        """A fresh incremental tool-call parser of this format, for a request declaring `tools`."""
        return self.parser_cls(tools)

    def reply_stream(self, tools: Sequence[dict] | None = None) -> ReplyStream:
        """A fresh incremental parser of whole replies (reasoning if configured, content, tool calls) for a request
        declaring `tools` (as `finish` takes them, so a streamed reply parses as the same reply unstreamed)."""
        return ReplyStream(self.parser_cls(tools), self.reasoning_cls() if self.reasoning_cls else None)


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
