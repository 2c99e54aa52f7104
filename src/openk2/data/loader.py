"""Deterministic, resumable loader of packed batches drawn from a weighted mixture of sources."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import numpy as np
import torch

from openk2.data.corpus import SPLITS, CorpusConfig, TokenizedDocs, tokenize_corpus
from openk2.data.packing import Packer, collate
from openk2.data.tokenizer import K2Tokenizer

STATE_VERSION = 1


class PackedLoader:
    """Iterator of batches {input_ids, labels, position_ids} ([batch_size, seq_len] LongTensors).

    Mixture rule: the next whole document comes from the source with the fewest tokens emitted so far
    relative to its weight, so each source's share of tokens tracks its weight at every point. Each
    source walks its documents in a seeded per-epoch shuffle (train) or in order (val) and starts a new
    epoch when it runs out; with `loop=False` an exhausted source drops out and iteration stops once all
    have, discarding the last incomplete batch.
    """

    def __init__(
        self,
        config: CorpusConfig,
        tokenizer: K2Tokenizer,
        batch_size: int,
        split: str = "train",
        loop: bool = True,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.config, self.tokenizer, self.batch_size = config, tokenizer, batch_size
        self.split, self.loop = split, loop
        self.corpus = tokenize_corpus(config, tokenizer)
        weights = config.weights
        self._docs: dict[str, TokenizedDocs] = {}
        self._weights: dict[str, float] = {}
        for name, per in self.corpus.docs.items():
            if len(per[split]) > 0:
                self._docs[name], self._weights[name] = per[split], weights[name]
        if not self._docs:
            raise ValueError(
                f"no {split} documents in any source with positive weight"
                + (" (is val_fraction 0?)" if split == "val" else "")
            )
        self._packer = Packer(config.seq_len, tokenizer.eos_id)
        self._epoch = dict.fromkeys(self._docs, 0)
        self._cursor = dict.fromkeys(self._docs, 0)
        self._emitted = dict.fromkeys(self._docs, 0)
        self._order: dict[str, tuple[int, np.ndarray]] = {}
        self.batches = 0

    @property
    def epochs(self) -> dict[str, int]:
        """Completed passes over each source's documents."""
        return dict(self._epoch)

    @property
    def tokens_emitted(self) -> dict[str, int]:
        """Tokens (EOS included) each source has contributed so far."""
        return dict(self._emitted)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        rows = []
        while len(rows) < self.batch_size:
            while not self._packer.ready():
                doc = self._next_document()
                if doc is None:
                    raise StopIteration
                self._packer.add(doc)
            rows.append(self._packer.pop_row())
        self.batches += 1
        return collate(rows)

    def _next_document(self) -> np.ndarray | None:
        live = [n for n in self._docs if self.loop or self._epoch[n] == 0]
        if not live:
            return None
        name = min(live, key=lambda n: self._emitted[n] / self._weights[n])  # ties: config order
        docs = self._docs[name]
        doc = docs.doc(int(self._permutation(name)[self._cursor[name]]))
        self._cursor[name] += 1
        if self._cursor[name] == len(docs):
            self._epoch[name] += 1
            self._cursor[name] = 0
        self._emitted[name] += len(doc) + 1
        return doc

    def _permutation(self, name: str) -> np.ndarray:
        epoch = self._epoch[name]
        cached = self._order.get(name)
        if cached is None or cached[0] != epoch:
            n = len(self._docs[name])
            if self.split == "train":
                rng = np.random.default_rng([self.config.seed, zlib.crc32(name.encode()), epoch])
                order = rng.permutation(n)
            else:
                order = np.arange(n)
            self._order[name] = cached = (epoch, order)
        return cached[1]

    def state_dict(self) -> dict:
        """Stream position (JSON-serialisable); a loader restored from it yields the same next batches."""
        return {
            "version": STATE_VERSION,
            "corpus_key": self.corpus.key,
            "split": self.split,
            "batches": self.batches,
            "sources": {
                n: {"epoch": self._epoch[n], "cursor": self._cursor[n], "emitted": self._emitted[n]}
                for n in self._docs
            },
            "packer": self._packer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict(); the corpus, tokenizer and split must be the same."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported loader state version {state.get('version')!r}")
        if state["corpus_key"] != self.corpus.key or state["split"] != self.split:
            raise ValueError("loader state was saved for a different corpus, tokenizer or split")
        if set(state["sources"]) != set(self._docs):
            raise ValueError(
                f"loader state has sources {sorted(state['sources'])}, expected {sorted(self._docs)}"
            )
        for name, s in state["sources"].items():
            self._epoch[name], self._cursor[name], self._emitted[name] = s["epoch"], s["cursor"], s["emitted"]
        self._packer.load_state_dict(state["packer"])
        self.batches = state["batches"]
