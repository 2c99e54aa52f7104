"""The server-sent events of one streamed chat completion, in the shape OpenAI's own API sends.

Each `data:` chunk carries exactly one `choices` entry, so a reader that looks only at `choices[0]` sees
everything; a sample (`n > 1`) writes its own chunks, told apart by `index`. Per sample, in order:

    {"delta": {"role": "assistant", "content": ""}}                               first
    {"delta": {"reasoning_content": "..."}}                                          with a reasoning parser
    {"delta": {"content": "..."}}
    {"delta": {"tool_calls": [{"index": 0, "id": "...", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}}    a call opens
    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\": "}}]}}  its arguments
    {"delta": {}, "finish_reason": "tool_calls"}                                     last

then, with `stream_options.include_usage`, one chunk with `"choices": []` and the usage (every earlier chunk
has `"usage": null`, as OpenAI sends it), and `data: [DONE]`.
"""

from __future__ import annotations

import json
from typing import Any

from openk2.chat import ReplyDelta
from openk2.chat.format import reply_finish_reason

# A choice's openk2 extension field: notes on tool calls the parser dropped (an id naming no declared function),
# on the non-streamed choice and on the streamed choice's last chunk; OpenAI clients keep unknown fields.
NOTES_FIELD = "openk2_notes"


class StreamWriter:
    """Builds the SSE chunks of one request; remembers which samples made tool calls."""

    def __init__(self, request_id: str, model: str, created: int, include_usage: bool) -> None:
        self.request_id, self.model, self.created = request_id, model, created
        self.include_usage = include_usage
        self.called: set[int] = set()

    def _sse(self, choices: list[dict], usage: dict | None = None) -> bytes:
        body: dict[str, Any] = {"id": self.request_id, "choices": choices, "created": self.created,
                                "model": self.model, "object": "chat.completion.chunk", "system_fingerprint": None}
        if self.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    def _choice(self, i: int, delta: dict, logprobs: list[dict] | None = None, reason: str | None = None) -> bytes:
        lp = {"content": logprobs, "refusal": None} if logprobs else None
        return self._sse([{"index": i, "delta": delta, "finish_reason": reason, "logprobs": lp}])

    def role(self, i: int) -> bytes:
        """The chunk that opens sample i."""
        return self._choice(i, {"role": "assistant", "content": ""})

    def deltas(self, i: int, delta: ReplyDelta, logprobs: list[dict] | None = None) -> list[bytes]:
        """Chunks for what sample i made certain: reasoning, content, then one chunk per tool-call delta.

        The tokens' logprobs ride on the first chunk (alone, with an empty delta, if nothing else is certain).
        """
        parts: list[dict] = []
        if delta.reasoning:
            parts.append({"reasoning_content": delta.reasoning})
        if delta.content:
            parts.append({"content": delta.content})
        for call in delta.tool_calls:
            parts.append({"tool_calls": [call]})
            self.called.add(i)
        if not parts and logprobs:
            parts.append({})
        return [self._choice(i, part, logprobs if k == 0 else None) for k, part in enumerate(parts)]

    def finish(self, i: int, finish_reason: str, notes: list[str] | None = None) -> bytes:
        """The last chunk of sample i: an empty delta with the finish reason (`tool_calls` if it called), and the
        notes on calls the parser dropped (choice field NOTES_FIELD) when there are any."""
        choice = {"index": i, "delta": {}, "finish_reason": reply_finish_reason(i in self.called, finish_reason),
                  "logprobs": None}
        if notes:
            choice[NOTES_FIELD] = list(notes)
        return self._sse([choice])

    def usage(self, usage: dict) -> bytes | None:
        """The usage chunk (no choices), if the client asked for it."""
        return self._sse([], usage) if self.include_usage else None
