"""K2-Thinking's reasoning format, parsed incrementally.

What the model writes after `<|im_assistant|>assistant<|im_middle|>` (one line here):

    <think>The user wants the weather; call the tool.</think>Let me check.<|tool_calls_section_begin|>...

As vLLM's `kimi_k2` reasoning parser reads it: the output opens in reasoning (a `<think>` at its very start
is consumed, none is required); reasoning ends at the first `</think>` (consumed) or implicitly where a
tool-call section begins (`<|tool_calls_section_begin|>` stays, as content, for the tool parser); output
that never ends its reasoning is all reasoning. openk2 adds interleaved thinking: a later
`<think>...</think>` block in the content (outside a tool-call section, so arguments that mention
`<think>` are left alone) is reasoning too, and ends the same way.

Streaming: a tail of the buffer that could still grow into a marker is held back until the next delta.
"""

from __future__ import annotations

from openk2.chat.reasoning_parsers.base import ReasoningDelta, ReasoningParser
from openk2.chat.tool_parsers.kimi_k2 import CALL_BEGIN, SECTION_BEGIN, SECTION_END

THINK_START, THINK_END = "<think>", "</think>"
_START, _REASONING, _CONTENT, _SECTION = "start", "reasoning", "content", "section"
# state -> markers that end it
_ENDS = {
    _REASONING: (THINK_END, SECTION_BEGIN),
    _CONTENT: (THINK_START, SECTION_BEGIN, CALL_BEGIN),
    _SECTION: (SECTION_END,),
}


def _held_tail(text: str, markers: tuple[str, ...]) -> int:
    """Start of the longest tail of `text` that is a proper prefix of a marker, or len(text) if none."""
    for start in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
        if any(m.startswith(text[start:]) for m in markers):
            return start
    return len(text)


class KimiK2ReasoningParser(ReasoningParser):
    """Incremental `<think>...</think>` splitter for K2-Thinking output."""

    name = "kimi_k2"

    def reset(self) -> None:
        """Forget all state, ready for a new output."""
        self._buf = ""
        self._state = _START
        self._finished = False

    def feed(self, delta: str) -> ReasoningDelta:
        """Consume the next piece of model output; return what is now certain."""
        if self._finished:
            raise ValueError("feed() after finish(); call reset() to parse another output")
        self._buf += delta
        out = ReasoningDelta()
        self._drain(out, final=False)
        return out

    def finish(self) -> ReasoningDelta:
        """End of output: flush held-back text."""
        if self._finished:
            raise ValueError("finish() called twice; call reset() to parse another output")
        out = ReasoningDelta()
        self._drain(out, final=True)
        self._finished = True
        return out

    def _emit(self, text: str, out: ReasoningDelta) -> None:
        if self._state == _REASONING:
            out.reasoning += text
        else:
            out.content += text

    def _drain(self, out: ReasoningDelta, final: bool) -> None:
        while self._buf or (final and self._state == _START):
            if self._state == _START:
                if not final and len(self._buf) < len(THINK_START) and THINK_START.startswith(self._buf):
                    return  # may still become the opening <think>
                if self._buf.startswith(THINK_START):
                    self._buf = self._buf[len(THINK_START):]
                self._state = _REASONING
                continue
            markers = _ENDS[self._state]
            found = [(self._buf.find(m), m) for m in markers if m in self._buf]
            if not found:
                cut = len(self._buf) if final else _held_tail(self._buf, markers)
                self._emit(self._buf[:cut], out)
                self._buf = self._buf[cut:]
                return
            pos, marker = min(found)
            self._emit(self._buf[:pos], out)
            self._buf = self._buf[pos + len(marker):]
            if marker in (THINK_START, THINK_END):
                self._state = _REASONING if marker == THINK_START else _CONTENT
            else:  # a tool-call marker: it belongs to the content, for the tool parser
                out.content += marker
                self._state = _CONTENT if marker == SECTION_END else _SECTION
