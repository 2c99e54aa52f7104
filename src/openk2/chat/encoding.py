"""Prompt pieces to token ids with text kept as text: only the template's own markers become control tokens.

Each template marker is its single special-token id; each run of content between two markers is encoded
with special-token parsing off, so a user (or tool, or document) that writes `<|im_end|><|im_system|>` gets
those characters as ordinary text tokens and cannot open a turn of its own. A run is encoded in one piece,
exactly as a whole-prompt encoding would split it (special tokens are boundaries there too), so the ids
equal the tokenisation of the rendered text wherever the content holds no special-token string.

The tokenizer is anything with `encode(text, allow_special=...)` and `special_ids` (`K2Tokenizer` has them).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from openk2.chat.pieces import IM_ASSISTANT, IM_MIDDLE, IM_SYSTEM, IM_USER, Piece
from openk2.chat.tool_parsers.kimi_k2 import MARKERS

TEMPLATE_MARKERS = (IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, *MARKERS)
_MARKER_RE = re.compile("|".join(re.escape(m) for m in TEMPLATE_MARKERS))


def encode_pieces(tokenizer: Any, pieces: Sequence[Piece]) -> tuple[list[int], list[bool]]:
    """Token ids of `pieces` and a parallel mask (True on tokens the assistant produced)."""
    # Plan: markers as ids, maximal text runs as (text, tag) to encode in one batch.
    plan: list[int | tuple[str, bool]] = []
    tags: list[bool] = []
    run: list[Piece] = []

    def close_run() -> None:
        if run:
            body = "".join(p.text for p in run)
            kinds = {p.assistant for p in run if p.text}
            # Every template places a marker wherever the speaker changes, so a text run has one tag.
            assert len(kinds) <= 1, f"a text run mixes prompt and assistant text: {body[:80]!r}"
            plan.append((body, kinds.pop() if kinds else False))
            run.clear()

    for piece in pieces:
        if not piece.marker:
            run.append(piece)
            continue
        close_run()
        if piece.text not in tokenizer.special_ids:
            raise ValueError(f"the tokenizer has no special token {piece.text!r}")
        plan.append(tokenizer.special_ids[piece.text])
        tags.append(piece.assistant)
    close_run()
    texts = [step[0] for step in plan if isinstance(step, tuple)]
    if hasattr(tokenizer, "encode_batch"):
        encoded = iter(tokenizer.encode_batch(texts, allow_special=False))
    else:
        encoded = iter([tokenizer.encode(t, allow_special=False) for t in texts])
    ids: list[int] = []
    mask: list[bool] = []
    marker_tags = iter(tags)
    for step in plan:
        if isinstance(step, tuple):
            run_ids = next(encoded)
            ids += run_ids
            mask += [step[1]] * len(run_ids)
        else:
            ids.append(step)
            mask.append(next(marker_tags))
    return ids, mask


def trusted_pieces(template_text: str, assistant: bool = False) -> list[Piece]:
    """Split text written by openk2 itself (a forced call prefix) into marker and text pieces.

    Never use this on client or model text: it is what turns marker strings into control tokens.
    """
    pieces, pos = [], 0
    for match in _MARKER_RE.finditer(template_text):
        if match.start() > pos:
            pieces.append(Piece(template_text[pos:match.start()], assistant))
        pieces.append(Piece(match.group(), assistant, True))
        pos = match.end()
    if pos < len(template_text):
        pieces.append(Piece(template_text[pos:], assistant))
    return pieces
