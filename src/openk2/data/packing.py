"""Packing documents into fixed-length rows with document-aware labels and position ids.

The token stream is doc_1 EOS doc_2 EOS ...; rows are windows of `seq_len` tokens and each row starts
with the last token of the previous row, so every next-token transition in the stream is a target in
exactly one row. Labels follow the HF convention (same shape as input_ids; the model scores
logits[:, :-1] against labels[:, 1:]): labels equal input_ids except that the first token of every
document is IGNORE_INDEX, because predicting it from the previous document's EOS is noise.
Position ids restart at 0 at the first token of every document and at the start of every row.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100


class Packer:
    """Buffers documents (EOS appended) and cuts them into overlapping rows of `seq_len` tokens."""

    def __init__(self, seq_len: int, eos_id: int) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {seq_len}")
        self.seq_len, self.eos_id = seq_len, eos_id
        self.tokens = np.zeros(0, dtype=np.int64)
        self.starts = np.zeros(0, dtype=bool)  # True where a document begins

    def add(self, doc: np.ndarray) -> None:
        """Append one document and its EOS to the buffer."""
        tokens = np.concatenate([np.asarray(doc, dtype=np.int64), [self.eos_id]])
        starts = np.zeros(len(tokens), dtype=bool)
        starts[0] = True
        self.tokens = np.concatenate([self.tokens, tokens])
        self.starts = np.concatenate([self.starts, starts])

    def ready(self) -> bool:
        """Whether a full row is buffered."""
        return len(self.tokens) >= self.seq_len

    def pop_row(self) -> tuple[np.ndarray, np.ndarray]:
        """The next row's tokens and document-start flags; its last token stays as the next row's first."""
        if not self.ready():
            raise ValueError(f"only {len(self.tokens)} tokens buffered, need {self.seq_len}")
        t = self.seq_len
        row = self.tokens[:t], self.starts[:t]
        self.tokens, self.starts = self.tokens[t - 1 :], self.starts[t - 1 :]
        return row

    def state_dict(self) -> dict:
        """Buffered tokens, JSON-serialisable."""
        return {"tokens": self.tokens.tolist(), "starts": np.flatnonzero(self.starts).tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the buffer saved by state_dict."""
        self.tokens = np.asarray(state["tokens"], dtype=np.int64)
        self.starts = np.zeros(len(self.tokens), dtype=bool)
        self.starts[np.asarray(state["starts"], dtype=np.int64)] = True


def row_labels(tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """HF-aligned labels: the tokens, with IGNORE_INDEX at every document's first token."""
    labels = np.array(tokens, dtype=np.int64)
    labels[starts] = IGNORE_INDEX
    return labels


def row_positions(starts: np.ndarray) -> np.ndarray:
    """Position ids counting from 0 at each document start (and at the row start)."""
    idx = np.arange(len(starts))
    last_start = np.maximum.accumulate(np.where(starts, idx, 0))
    return idx - last_start


def collate(rows: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack rows into a batch: input_ids, labels and position_ids, each a LongTensor [B, T]."""
    return {
        "input_ids": torch.from_numpy(np.stack([t for t, _ in rows]).astype(np.int64)),
        "labels": torch.from_numpy(np.stack([row_labels(t, s) for t, s in rows])),
        "position_ids": torch.from_numpy(np.stack([row_positions(s) for _, s in rows]).astype(np.int64)),
    }
