"""Cut a document into segments an LLM can rewrite in one call, and stitch the rewrites back together.

K2 rewrites long documents chunk by chunk (report section 2.2, "chunk-wise autoregressive generation") because
an LLM asked to rewrite a long text tends to shorten it. Cuts are made at the coarsest boundary that fits:
blank lines (paragraphs), then sentence ends and line breaks, then spaces, and only as a last resort inside a
word. Splitting is lossless: `"".join(split_segments(text, n)) == text`, each segment keeping the whitespace
that followed it, which `stitch` uses to join the rewrites with the same kind of break.
"""

from __future__ import annotations

import re

# Boundary patterns, coarsest first; a cut goes right after a match (the separator stays with the left piece).
_PARAGRAPH = re.compile(r"\n[ \t]*\n\s*")
_SENTENCE = re.compile(r"(?<=[.!?;:\u2026])[\"'\u201d\u2019)\]]*\s+|\n\s*")
_WORD = re.compile(r"\s+")
_LEVELS = (_PARAGRAPH, _SENTENCE, _WORD)


def split_segments(text: str, max_chars: int) -> list[str]:
    """Lossless cut of `text` into pieces of at most `max_chars` characters at the coarsest boundaries possible."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    return _pack(text, max_chars, 0) if text else []


def _pack(text: str, max_chars: int, level: int) -> list[str]:
    # Greedily fill segments with this level's pieces; a piece too long on its own is cut at the next level.
    if len(text) <= max_chars:
        return [text]
    if level == len(_LEVELS):
        return [text[i : i + max_chars] for i in range(0, len(text), max_chars)]
    segments: list[str] = []
    current = ""
    for piece in _cut_after(text, _LEVELS[level]):
        if len(piece) > max_chars:
            if current:
                segments.append(current)
                current = ""
            segments.extend(_pack(piece, max_chars, level + 1))
        elif len(current) + len(piece) > max_chars:
            segments.append(current)
            current = piece
        else:
            current += piece
    if current:
        segments.append(current)
    return segments


def _cut_after(text: str, boundary: re.Pattern[str]) -> list[str]:
    pieces, start = [], 0
    for match in boundary.finditer(text):
        if match.end() > start:
            pieces.append(text[start : match.end()])
            start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def trailing_break(segment: str) -> str:
    """The break a segment ends with, normalised: a blank line, a newline, a space, or nothing."""
    tail = segment[len(segment.rstrip()) :]
    if tail.count("\n") >= 2:
        return "\n\n"
    if "\n" in tail:
        return "\n"
    return " " if tail else ""


def stitch(sources: list[str], rewrites: list[str]) -> str:
    """Join rewrites of consecutive segments, each followed by the kind of break its source segment ended with.

    A source cut inside a word (no break) still gets a space: the rewrite of a fragment is a complete text.
    """
    if len(sources) != len(rewrites):
        raise ValueError(f"stitch needs one rewrite per segment, got {len(rewrites)} for {len(sources)}")
    parts = []
    for i, (source, rewrite) in enumerate(zip(sources, rewrites, strict=True)):
        parts.append(rewrite.strip())
        brk = trailing_break(source)
        if i < len(sources) - 1:
            parts.append(brk or " ")
        elif brk.startswith("\n"):
            parts.append("\n")  # a document that ended with a line break still does
    return "".join(parts)
