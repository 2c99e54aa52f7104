"""Kimi K2's tool-call format, parsed incrementally.

What the model writes after `<|im_assistant|>assistant<|im_middle|>` (one line here, none on the wire):

    Let me check both.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>

Content comes first; the calls sit in one section; each call id is `functions.{name}:{idx}` (or `{name}:{idx}`)
and the function name is read back out of it (`functions.get_weather.v2:3` names `get_weather.v2`); the id is
kept verbatim and `idx` is not the call's index (indices count this reply's calls from 0).

An id that names no function (a bare counter `0`, `call_3`, `weird@id`, `functions.invalid.0`) is resolved
from the request's declared tools (`resolve`): a declared name the id spells once its `functions.` prefix and
`:idx` suffix are cut off, else the only declared tool, else the one tool the arguments fit. Such a call is
announced when it can be resolved: at once when the id settles it, else when it closes. A call that cannot be
resolved, and a call with no `<|tool_call_argument_begin|>`, is dropped with a note (`DeltaMessage.dropped`).

Tolerated: the singular `<|tool_call_section_begin|>` / `<|tool_call_section_end|>` as section markers;
whitespace and newlines between the markers, around the id and around the arguments (all dropped); a
`<|tool_call_begin|>` with no section opened; a call or section that is never closed (the next marker or the
end of output closes it); two sections in one reply; no `<|im_end|>` at the end. Stray markers outside their
place are dropped, and text between calls inside a section is discarded. A section never closed that holds
no call is no section: its text, unless only whitespace, is content (held back until the end shows it).
Whitespace right after `<|tool_calls_section_end|>` is dropped unless more content follows it. Everything
after `<|im_end|>` is ignored.

Reported, never raised: a call whose arguments are not a JSON object (cut off, or malformed) is still
announced, with its raw argument text, and carries an error (see `base`).

Streaming: a marker can arrive split across deltas (`<|tool_ca` + `ll_begin|>`), so a tail of the
buffer that could still become a marker is held back until the next delta or `finish()`. A call whose id
names its function is announced (id + name) once its `<|tool_call_argument_begin|>` arrives; argument text
then streams, with trailing whitespace held back until it is known not to be the end.
"""

from __future__ import annotations

import re

from openk2.chat.tool_parsers.arguments import load_arguments
from openk2.chat.tool_parsers.base import DeltaMessage, ToolParser
from openk2.chat.tool_parsers.resolve import infer_tool

IM_END = "<|im_end|>"
SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END, IM_END)  # the template's own
# Section markers with singular "call", which K2 models are seen to write too (vLLM reads both); read as aliases.
MARKER_ALIASES = {"<|tool_call_section_begin|>": SECTION_BEGIN, "<|tool_call_section_end|>": SECTION_END}
_SCANNED = (*MARKERS, *MARKER_ALIASES)
_LONGEST_MARKER = max(map(len, _SCANNED))

CALL_ID_PREFIX = "functions."
# Function names: letters, digits, underscores, hyphens and dots; anything else would make the id ambiguous.
FUNCTION_NAME = re.compile(r"[\w.\-]+")
CALL_ID = re.compile(r"functions\.([\w.\-]+):(\d+)")  # the canonical form; group 1 is the function name
_NAMED_ID = re.compile(r"(?:functions\.)?([\w.\-]+):\d+")  # what vLLM and SGLang accept as naming a function
_ID_SUFFIX = re.compile(r":\d+$")

# Engine states.
_CONTENT, _SECTION, _HEADER, _ARGS, _DONE = "content", "section", "header", "args", "done"


def format_call_id(name: str, index: int) -> str:
    """K2's id for the `index`-th call, to function `name`."""
    return f"{CALL_ID_PREFIX}{name}:{index}"


def function_name_from_id(call_id: str) -> str | None:
    """The function a call id names (`functions.NAME:IDX` or `NAME:IDX` -> NAME), or None if it names none."""
    match = _NAMED_ID.fullmatch(call_id)
    return match.group(1) if match else None


def check_arguments(arguments: str) -> str | None:
    """Why `arguments` is not a JSON object, or None if it is."""
    value, error = load_arguments(arguments)
    if error is not None:
        return error
    if not isinstance(value, dict):
        return f"arguments must be a JSON object, got {type(value).__name__}"
    return None


def _partial_marker_at(text: str) -> int:
    """Start of a tail of `text` that could still grow into a marker, or len(text) if there is none."""
    # Markers hold "<" only as their first character, so only the last "<" can start such a tail.
    start = text.rfind("<", max(0, len(text) - _LONGEST_MARKER + 1))
    return start if start != -1 and any(m.startswith(text[start:]) for m in _SCANNED) else len(text)


class KimiK2ToolParser(ToolParser):
    """Incremental parser for K2's `<|tool_calls_section_begin|>` format."""

    name = "kimi_k2"
    section_begin = SECTION_BEGIN

    @classmethod
    def forced_prefix(cls, function_name: str | None) -> str:
        """`<section><call>functions.` (the model picks the function) or the whole header of call 0 to it."""
        if function_name is None:
            return f"{SECTION_BEGIN}{CALL_BEGIN}{CALL_ID_PREFIX}"
        return f"{SECTION_BEGIN}{CALL_BEGIN}{format_call_id(function_name, 0)}{ARGUMENT_BEGIN}"

    def reset(self) -> None:
        """Forget all state (the declared tools stay), ready for a new output."""
        self._buf = ""  # text not yet consumed; may end in a partial marker
        self._state = _CONTENT
        self._hold_ws = False  # in content just after a section: leading whitespace is held
        self._pending_ws = ""  # whitespace held back (content after a section, or argument tail)
        self._section_text = ""  # text of a section that has no call yet: content if the section never closes
        self._section_calls = 0  # calls begun in the open section
        self._header = ""  # the call id being read
        self._call_id = ""
        self._call_name: str | None = None  # None while the call waits for its arguments to resolve it
        self._args: list[str] = []  # the open call's argument text, as emitted (or held, if not announced)
        self._num_calls = 0  # calls announced so far
        self._finished = False

    def feed(self, delta: str) -> DeltaMessage:
        """Consume the next piece of model output; return what is now certain."""
        if self._finished:
            raise ValueError("feed() after finish(); call reset() to parse another output")
        self._buf += delta
        out = DeltaMessage()
        self._drain(out, final=False)
        return out

    def finish(self) -> DeltaMessage:
        """End of output: flush held-back text and close any open call."""
        if self._finished:
            raise ValueError("finish() called twice; call reset() to parse another output")
        out = DeltaMessage()
        self._drain(out, final=True)
        self._end(out, "the end of output")
        self._state, self._pending_ws, self._finished = _DONE, "", True
        return out

    # The scanner: split the buffer into text runs and markers, holding back a possible partial marker.

    def _drain(self, out: DeltaMessage, final: bool) -> None:
        """Consume as much of the buffer as is certain."""
        while self._buf and self._state != _DONE:
            pos = self._buf.find("<|")
            marker = next((m for m in _SCANNED if self._buf.startswith(m, pos)), None) if pos >= 0 else None
            if marker is not None:
                self._text(self._buf[:pos], out)
                self._buf = self._buf[pos + len(marker) :]
                self._marker(MARKER_ALIASES.get(marker, marker), out)
                continue
            could_grow = not final and pos >= 0 and any(m.startswith(self._buf[pos:]) for m in _SCANNED)
            if pos >= 0 and not could_grow:
                # "<|" that can no longer become a marker is ordinary text.
                self._text(self._buf[: pos + 2], out)
                self._buf = self._buf[pos + 2 :]
                continue
            cut = len(self._buf) if final else _partial_marker_at(self._buf)
            self._text(self._buf[:cut], out)
            self._buf = self._buf[cut:]
            break
        if self._state == _DONE:
            self._buf = ""

    def _text(self, text: str, out: DeltaMessage) -> None:
        """Handle a run of text containing no marker."""
        if not text:
            return
        if self._state == _CONTENT:
            if self._hold_ws:
                if not text.strip():
                    self._pending_ws += text
                    return
                text, self._pending_ws, self._hold_ws = self._pending_ws + text, "", False
            out.content += text
        elif self._state == _HEADER:
            self._header += text
        elif self._state == _ARGS:
            self._arg_text(text, out)
        elif self._section_calls == 0:
            self._section_text += text  # in a section before its first call: content if it never closes
        # In _SECTION after a call, text between calls is discarded.

    def _arg_text(self, text: str, out: DeltaMessage) -> None:
        """Take argument text, dropping leading whitespace and holding back trailing whitespace."""
        if not self._args:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            chunk = self._pending_ws + body
            self._pending_ws = ""
            self._args.append(chunk)
            if self._call_name is not None:
                out.tool_calls.append({"index": self._num_calls - 1, "function": {"arguments": chunk}})
        self._pending_ws += text[len(body) :]

    def _marker(self, marker: str, out: DeltaMessage) -> None:
        """Handle one marker in the current state."""
        if self._state == _HEADER:
            if marker == ARGUMENT_BEGIN:
                self._open_call(out)
                return
            self._drop_header(out, marker)
            self._state = _SECTION  # then let the marker act as it would between calls
        elif self._state == _ARGS:
            self._close_call(out)
            self._state = _SECTION
            if marker == CALL_END:
                return
        if marker == IM_END:
            self._end(out, IM_END)
            self._state = _DONE
        elif self._state == _CONTENT:
            if marker in (SECTION_BEGIN, CALL_BEGIN):
                self._pending_ws, self._hold_ws = "", False
                self._state, self._section_text, self._section_calls = _SECTION, "", 0
                if marker == CALL_BEGIN:  # a call with no section opened: open one implicitly
                    self._start_header()
        elif self._state == _SECTION:
            if marker == CALL_BEGIN:
                self._start_header()
            elif marker == SECTION_END:
                self._state, self._hold_ws, self._section_text = _CONTENT, True, ""

    def _end(self, out: DeltaMessage, where: str) -> None:
        """The output ends (`where`: `<|im_end|>` or its true end): close the open call, or the open section."""
        if self._state == _HEADER:
            self._drop_header(out, where)
        elif self._state == _ARGS:
            self._close_call(out)
        elif self._state == _SECTION and self._section_text.strip():
            out.content += self._section_text  # a section never closed and holding no call was no section
        self._section_text = ""

    # Calls.

    def _start_header(self) -> None:
        """Begin reading a call id."""
        self._state, self._header = _HEADER, ""
        self._section_calls += 1
        self._section_text = ""

    def _drop_header(self, out: DeltaMessage, before: str) -> None:
        """A call id that no `<|tool_call_argument_begin|>` followed: drop the call."""
        out.dropped.append(f"dropped tool call {self._header.strip()!r}: no {ARGUMENT_BEGIN} before {before}")

    def _open_call(self, out: DeltaMessage) -> None:
        """The call id is read: announce the call now if the id settles its function, else wait for its arguments."""
        self._call_id, self._args, self._pending_ws = self._header.strip(), [], ""
        self._call_name = self._name_from_id(self._call_id)
        self._state = _ARGS
        if self._call_name is not None:
            self._announce(out)

    def _name_from_id(self, call_id: str) -> str | None:
        """The function a call id settles: named in it, a declared name it spells, or the only declared tool."""
        name = function_name_from_id(call_id)
        if name is not None or not call_id:
            return name  # an empty id is never resolved: a client could not answer the call
        bare = _ID_SUFFIX.sub("", call_id.removeprefix(CALL_ID_PREFIX))
        names = [t.name for t in self.tools]
        if bare in names:
            return bare
        return names[0] if len(names) == 1 else None

    def _announce(self, out: DeltaMessage) -> None:
        """Emit the opening delta of the open call (and any argument text held while it waited)."""
        index = self._num_calls
        self._num_calls += 1
        out.tool_calls.append(
            {"index": index, "id": self._call_id, "type": "function",
             "function": {"name": self._call_name, "arguments": ""}}
        )
        if self._args:
            out.tool_calls.append({"index": index, "function": {"arguments": "".join(self._args)}})

    def _close_call(self, out: DeltaMessage) -> None:
        """Close the open call: drop its trailing whitespace; resolve it if it waited; report any error."""
        self._pending_ws = ""
        arguments = "".join(self._args)
        if self._call_name is None:
            self._call_name, why = infer_tool(self.tools, arguments) if self._call_id else (None, "it is empty")
            if self._call_name is None:
                out.dropped.append(f"dropped tool call {self._call_id!r}: its id names no function and {why}")
                return
            self._announce(out)
        error = check_arguments(arguments)
        if error is not None:
            out.errors.append({"index": self._num_calls - 1, "error": error})
