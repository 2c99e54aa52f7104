"""The tool-call parser interface: one incremental engine behind both streaming and non-streaming use.

A parser turns a model's raw output (the text after the generation prompt) into assistant content and
tool calls. Subclasses implement only the incremental side: `feed(delta)` consumes a piece of text and
returns what became certain, `finish()` flushes the end of the stream. `parse(text)` is defined here
as "feed everything to a fresh parser, then finish", so streaming and non-streaming share one engine
and cannot disagree.

Streaming output follows OpenAI's chat-completion chunk shape. The first delta of a call carries
`{"index", "id", "type": "function", "function": {"name", "arguments": ""}}`; later ones carry only
`{"index", "function": {"arguments": <more text>}}`. A call whose arguments are not a JSON object is still
reported; `DeltaMessage.errors` gets `{"index", "error"}` when the call closes, and the assembled
`ToolCall.error` holds the message. A call that names no function (and cannot be resolved from the
request's declared tools) is never announced: it is dropped, and `DeltaMessage.dropped` gets one note saying
why. Indices count only announced calls.

A parser is built with the request's declared tools (OpenAI tool specs, or none), which it may use to
resolve calls; `reset()` keeps them, and `parse` runs a fresh parser with the same tools.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from openk2.chat.tool_parsers.resolve import DeclaredTool, declared_tools


@dataclass
class DeltaMessage:
    """What one `feed`/`finish` call made certain: content text, tool-call deltas, call errors, dropped calls."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # one note per call dropped (why), never announced

    def is_empty(self) -> bool:
        """Whether this delta carries nothing."""
        return not (self.content or self.tool_calls or self.errors or self.dropped)


@dataclass
class ToolCall:
    """One assembled tool call; `error` is None when the call is well formed."""

    index: int
    id: str
    name: str
    arguments: str
    error: str | None = None

    def to_openai(self) -> dict:
        """The call in OpenAI's message shape, plus an "error" key only when malformed."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if self.error is not None:
            call["error"] = self.error
        return call


@dataclass
class ParseResult:
    """A whole output, parsed: assistant content, tool calls in emission order, notes on dropped calls."""

    content: str
    tool_calls: list[ToolCall]
    dropped: list[str] = field(default_factory=list)


class StreamAccumulator:
    """Assembles a stream of `DeltaMessage`s into a `ParseResult`, checking the streaming contract."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._dropped: list[str] = []

    def add(self, delta: DeltaMessage) -> None:
        """Fold one delta in; ValueError if it breaks the OpenAI streaming shape."""
        self._content.append(delta.content)
        for chunk in delta.tool_calls:
            index = chunk["index"]
            if "id" in chunk:
                # A call opens exactly once, and indices count up from 0 without gaps.
                if index != len(self._calls):
                    raise ValueError(f"tool call {index} opened out of order (expected {len(self._calls)})")
                fn = chunk["function"]
                self._calls.append(ToolCall(index, chunk["id"], fn["name"], fn.get("arguments", "")))
            else:
                self._call(index).arguments += chunk["function"]["arguments"]
        for err in delta.errors:
            call = self._call(err["index"])
            call.error = err["error"] if call.error is None else f"{call.error}; {err['error']}"
        self._dropped += delta.dropped

    def _call(self, index: int) -> ToolCall:
        """The open call with this index."""
        if not 0 <= index < len(self._calls):
            raise ValueError(f"delta for tool call {index}, which was never opened")
        return self._calls[index]

    def result(self) -> ParseResult:
        """Everything accumulated so far."""
        return ParseResult("".join(self._content), list(self._calls), list(self._dropped))


class ToolParser(ABC):
    """Base class: subclasses implement `reset`, `feed` and `finish`; the constructor takes the declared tools.

    A format also declares how `tool_choice` is enforced in it: `section_begin` is the special token that
    opens its tool calls (a sample that emits it under `tool_choice="none"` ends there), and
    `forced_prefix` is the text written for the model at the start of its turn so that it must call.
    """

    name: ClassVar[str]
    section_begin: ClassVar[str]

    @classmethod
    @abstractmethod
    def forced_prefix(cls, function_name: str | None) -> str:
        """Assistant-turn text that commits the model to a call: of any function (None) or of `function_name`."""

    def __init__(self, tools: Sequence[Any] | None = None) -> None:
        self.tools: tuple[DeclaredTool, ...] = declared_tools(tools)  # the request's tools; reset() keeps them
        self.reset()

    @abstractmethod
    def reset(self) -> None:
        """Forget all state, ready for a new output."""

    @abstractmethod
    def feed(self, delta: str) -> DeltaMessage:
        """Consume the next piece of model output; return what is now certain."""

    @abstractmethod
    def finish(self) -> DeltaMessage:
        """End of output: flush held-back text and close any open call."""

    def parse(self, text: str) -> ParseResult:
        """Parse a complete output (runs the streaming engine on a fresh parser, in one piece)."""
        parser = type(self)(self.tools)
        acc = StreamAccumulator()
        acc.add(parser.feed(text))
        acc.add(parser.finish())
        return acc.result()
