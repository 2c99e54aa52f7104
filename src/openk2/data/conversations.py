"""Chat / tool-use conversations for supervised fine-tuning: JSONL in, packed rows with assistant-only labels out.

A conversation is one JSON object {"messages": [...OpenAI messages...], "tools": [...optional function
specs...]}. It is rendered with K2's chat template (`openk2.chat.template.render_pieces`, every turn closed
with `<|im_end|>`, as it is when the conversation goes on) and tokenised piece by piece, so the loss mask is
exact: an assistant turn's content, tool-call section and closing `<|im_end|>` are trained on, everything
else (system, user, tool results, role headers) is context only. Exactly as prompts at inference
(`openk2.chat.encoding.encode_pieces`), only the template's markers become special-token ids; message text,
tool results, ids and arguments are encoded as plain text whatever they spell, so a conversation cannot
smuggle a control token into training data.

Packing: whole conversations fill rows of `seq_len` tokens (the rest is padding); each token carries the
index of its conversation within the row (`segment_ids`, -1 for padding) and a position id that restarts
at 0 per conversation, so with `K2ForCausalLM(..., position_ids=, segment_ids=)` each conversation sees only
itself, exactly as if it ran alone. A conversation longer than `seq_len` is truncated (or skipped) and counted.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from openk2.chat.encoding import encode_pieces
from openk2.chat.pieces import Piece, mask_segments
from openk2.chat.template import GENERATION_PROMPT, Segment, render_pieces
from openk2.data.packing import IGNORE_INDEX
from openk2.data.tokenizer import K2Tokenizer

OVERLONG_POLICIES = ("truncate", "skip")
PAD_SEGMENT = -1
STATE_VERSION = 1


# ---------------------------------------------------------------------------------------------- reading
def conversation_pieces(conversation: object) -> list[Piece]:
    """Validate one conversation and render it as pieces: every turn closed, no generation prompt."""
    if not isinstance(conversation, dict):
        raise ValueError(f"a conversation must be a JSON object, got {type(conversation).__name__}")
    unknown = sorted(set(conversation) - {"messages", "tools"})
    if unknown:
        raise ValueError(f"unknown conversation key(s) {unknown}; expected 'messages' and optional 'tools'")
    messages, tools = conversation.get("messages"), conversation.get("tools")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"'tools' must be a list, got {type(tools).__name__}")
    # The template leaves the last turn open without a generation prompt (a prefill); training text is the
    # conversation as the template renders it when it continues, i.e. with the generation prompt cut off.
    pieces = render_pieces(messages, tools or None, add_generation_prompt=True)
    tail = "".join(p.text for p in pieces[-3:])
    assert tail == GENERATION_PROMPT, tail
    pieces = pieces[:-3]
    if not any(p.assistant and p.text for p in pieces):
        raise ValueError("no assistant turn to train on")
    return pieces


def conversation_segments(conversation: object) -> list[Segment]:
    """`conversation_pieces` as (text, is_assistant) segments, neighbours with the same tag merged."""
    return mask_segments(conversation_pieces(conversation))


def read_conversations(path: str | Path) -> list[dict]:
    """Read and validate a conversation JSONL file (blank lines skipped); errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"conversation file {path} not found")
    conversations = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                conversation = json.loads(line)
                conversation_pieces(conversation)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            except ValueError as err:
                raise ValueError(f"{path}:{lineno}: {err}") from None
            conversations.append(conversation)
    if not conversations:
        raise ValueError(f"{path} holds no conversations")
    return conversations


def write_conversations(path: str | Path, conversations: Sequence[dict]) -> Path:
    """Write conversations as JSONL (atomically: a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations), encoding="utf-8")
    tmp.replace(path)
    return path


def split_conversations(conversations: Sequence[dict], val_fraction: float, seed: int = 0
                        ) -> tuple[list[dict], list[dict]]:
    """A seeded (train, val) split; val gets round(n * val_fraction) conversations, at least one if fraction > 0."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    n_val = max(1, round(len(conversations) * val_fraction)) if val_fraction > 0 else 0
    if n_val >= len(conversations):
        raise ValueError(f"{len(conversations)} conversations are too few to hold out {n_val} for validation")
    order = np.random.default_rng([seed, 0x5F7]).permutation(len(conversations))
    val = set(order[:n_val].tolist())
    return ([c for i, c in enumerate(conversations) if i not in val],
            [c for i, c in enumerate(conversations) if i in val])


# ---------------------------------------------------------------------------------------------- tokenising
def tokenize_pieces(pieces: Sequence[Piece], tokenizer: K2Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [N] and loss mask [N] (True on assistant tokens) of rendered pieces (markers as control tokens,
    all other text as plain text)."""
    ids, mask = encode_pieces(tokenizer, pieces)
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)


@dataclass
class TokenizedConversations:
    """Conversations as one flat token array with a parallel loss mask; conversation i is [offsets[i], offsets[i+1])."""

    tokens: np.ndarray  # [N] int64
    mask: np.ndarray  # [N] bool, True where the assistant produced the token
    offsets: np.ndarray  # [n + 1] int64
    truncated: int = 0  # conversations cut to seq_len
    skipped: int = 0  # conversations dropped (over-long under "skip", or no assistant token left after cutting)
    key: str = field(default="")  # fingerprint of tokens and mask (a resumed loader must see the same data)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def conversation(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.tokens[lo:hi], self.mask[lo:hi]

    def targets(self) -> np.ndarray:
        """The tokens trained on (assistant tokens), for baselines."""
        return self.tokens[self.mask]


def tokenize_conversations(
    conversations: Sequence[dict], tokenizer: K2Tokenizer, seq_len: int, overlong: str = "truncate"
) -> TokenizedConversations:
    """Tokenise conversations; one longer than `seq_len` is cut to its first seq_len tokens or skipped."""
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    truncated = skipped = 0
    for i, conversation in enumerate(conversations):
        try:
            ids, mask = tokenize_pieces(conversation_pieces(conversation), tokenizer)
        except ValueError as err:
            raise ValueError(f"conversation {i}: {err}") from None
        if len(ids) > seq_len:
            if overlong == "skip":
                skipped += 1
                continue
            ids, mask = ids[:seq_len], mask[:seq_len]
            if not mask.any():
                skipped += 1
                continue
            truncated += 1
        pieces.append((ids, mask))
    if not pieces:
        raise ValueError(f"no conversation is left to train on ({skipped} skipped as longer than {seq_len} tokens)")
    tokens = np.concatenate([p[0] for p in pieces])
    mask = np.concatenate([p[1] for p in pieces])
    offsets = np.concatenate([[0], np.cumsum([len(p[0]) for p in pieces])]).astype(np.int64)
    digest = hashlib.sha256(tokens.tobytes())
    digest.update(np.packbits(mask).tobytes())
    digest.update(offsets.tobytes())
    return TokenizedConversations(tokens, mask, offsets, truncated, skipped, digest.hexdigest()[:16])


# ---------------------------------------------------------------------------------------------- packing
def pack_row(parts: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One row from whole conversations (ids, mask) that fit in seq_len together, padded at the end.

    labels hold the token where the mask is set, else IGNORE_INDEX (HF-aligned: the model scores
    logits[t-1] against labels[t]); the first token of a conversation is never an assistant token,
    so no target crosses from one conversation into the next.
    """
    used = sum(len(ids) for ids, _ in parts)
    if used > seq_len:
        raise ValueError(f"{used} tokens do not fit in a row of {seq_len}")
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    segment_ids = np.full(seq_len, PAD_SEGMENT, dtype=np.int64)
    position_ids = np.zeros(seq_len, dtype=np.int64)
    start = 0
    for k, (ids, mask) in enumerate(parts):
        end = start + len(ids)
        input_ids[start:end] = ids
        labels[start:end] = np.where(mask, ids, IGNORE_INDEX)
        segment_ids[start:end] = k
        position_ids[start:end] = np.arange(len(ids))
        start = end
    position_ids[start:] = np.arange(seq_len - start)
    return {"input_ids": input_ids, "labels": labels, "segment_ids": segment_ids, "position_ids": position_ids}


class ConversationLoader:
    """Iterator of packed SFT batches {input_ids, labels, position_ids, segment_ids} ([B, seq_len] LongTensors).

    Conversations are taken in a seeded per-epoch shuffle (`shuffle=True`, for training) or in order; a row
    takes whole conversations while the next one fits. With `loop=False` iteration ends after one pass and
    the last batch may be short. The position in the stream is a small state_dict, like PackedLoader's.
    """

    def __init__(self, data: TokenizedConversations, batch_size: int, seq_len: int, pad_id: int,
                 seed: int = 0, shuffle: bool = True, loop: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        longest = int(data.lengths().max())
        if longest > seq_len:
            raise ValueError(f"a conversation has {longest} tokens, more than seq_len={seq_len}")
        self.data, self.batch_size, self.seq_len, self.pad_id = data, batch_size, seq_len, pad_id
        self.seed, self.shuffle, self.loop = seed, shuffle, loop
        self.epoch = self.cursor = self.batches = 0
        self._order: tuple[int, np.ndarray] | None = None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        rows = []
        while len(rows) < self.batch_size:
            row = self._next_row()
            if row is None:
                break
            rows.append(row)
        if not rows:
            raise StopIteration
        self.batches += 1
        return {key: torch.from_numpy(np.stack([r[key] for r in rows])) for key in rows[0]}

    def next_row(self) -> dict[str, np.ndarray]:
        """The next packed row alone ({input_ids, labels, segment_ids, position_ids} [seq_len] arrays)."""
        row = self._next_row()
        if row is None:
            raise StopIteration
        return row

    def _next_row(self) -> dict[str, np.ndarray] | None:
        parts, used = [], 0
        while not (self.epoch > 0 and not self.loop):
            index = int(self._permutation()[self.cursor])
            length = int(self.data.offsets[index + 1] - self.data.offsets[index])
            if used + length > self.seq_len:
                break  # it opens the next row
            parts.append(self.data.conversation(index))
            used += length
            self.cursor += 1
            if self.cursor == len(self.data):
                self.epoch, self.cursor = self.epoch + 1, 0
        return pack_row(parts, self.seq_len, self.pad_id) if parts else None

    def _permutation(self) -> np.ndarray:
        if self._order is None or self._order[0] != self.epoch:
            n = len(self.data)
            order = np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order = (self.epoch, order)
        return self._order[1]

    def state_dict(self) -> dict:
        """Stream position (JSON-serialisable); a loader restored from it yields the same next batches."""
        return {"version": STATE_VERSION, "data_key": self.data.key, "seq_len": self.seq_len, "seed": self.seed,
                "epoch": self.epoch, "cursor": self.cursor, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict(); the conversations, tokenizer, seq_len and seed must be the same."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported conversation loader state version {state.get('version')!r}")
        if (state["data_key"], state["seq_len"], state["seed"]) != (self.data.key, self.seq_len, self.seed):
            raise ValueError("loader state was saved for different conversations, tokenizer, seq_len or seed")
        self.epoch, self.cursor, self.batches = state["epoch"], state["cursor"], state["batches"]
