"""Deterministic, resumable loader of packed batches drawn from a weighted mixture of sources."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import numpy as np
import torch

from openk2.data.corpus import SPLITS, CorpusConfig, TokenizedCorpus, tokenize_corpus
from openk2.data.packing import collate
from openk2.data.shard_docs import ShardCorpus, open_shards
from openk2.data.shards import write_shards
from openk2.data.tokenizer import K2Tokenizer

STATE_VERSION = 2


class PackedLoader:
    """Iterator of batches {input_ids, labels, position_ids} ([rows, seq_len] LongTensors).

    Mixture rule: the next whole document comes from the source with the fewest tokens emitted so far
    relative to its weight, so each source's share of tokens tracks its weight at every point. Each
    source walks its documents in a seeded per-epoch shuffle (train) or in order (val) and starts a new
    epoch when it runs out; with `loop=False` an exhausted source drops out and iteration stops once all
    have, discarding the last incomplete batch. Packing follows openk2.data.packing: the stream is
    doc EOS doc EOS ..., global row r is its window [r*(T-1), r*(T-1)+T).

    `batch_size` is the global batch. With `num_data_ranks` > 1 this rank gets rows
    [data_rank*b, (data_rank+1)*b) of each global batch (b = batch_size / num_data_ranks): every rank walks
    the global stream by document lengths alone (the index) and reads the tokens only of the documents
    that overlap its own rows. The position is therefore the same on every rank and independent of the
    layout. With `config.shard_dir` set the documents are memory-mapped token shards (written there first
    if missing), so RAM does not grow with the corpus; otherwise the corpus is tokenised into RAM.
    """

    def __init__(
        self,
        config: CorpusConfig,
        tokenizer: K2Tokenizer,
        batch_size: int,
        split: str = "train",
        loop: bool = True,
        data_rank: int = 0,
        num_data_ranks: int = 1,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if num_data_ranks < 1 or not 0 <= data_rank < num_data_ranks or batch_size % num_data_ranks:
            raise ValueError(f"batch_size {batch_size} must split evenly over {num_data_ranks} data ranks "
                             f"(rank {data_rank})")
        self.config, self.tokenizer, self.batch_size = config, tokenizer, batch_size
        self.split, self.loop = split, loop
        self.data_rank, self.num_data_ranks = data_rank, num_data_ranks
        self.corpus: TokenizedCorpus | ShardCorpus
        if config.shard_dir:
            write_shards(config, tokenizer)  # no-op when every source is already complete
            self.corpus = open_shards(config, tokenizer)
        else:
            self.corpus = tokenize_corpus(config, tokenizer)
        weights = config.weights
        self._docs = {}
        self._weights: dict[str, float] = {}
        for name, per in self.corpus.docs.items():
            if len(per[split]) > 0:
                self._docs[name], self._weights[name] = per[split], weights[name]
        if not self._docs:
            raise ValueError(
                f"no {split} documents in any source with positive weight"
                + (" (is val_fraction 0?)" if split == "val" else "")
            )
        self._seq_len, self._eos = config.seq_len, tokenizer.eos_id
        self._epoch = dict.fromkeys(self._docs, 0)
        self._cursor = dict.fromkeys(self._docs, 0)
        self._emitted = dict.fromkeys(self._docs, 0)
        self._order: dict[str, tuple[int, np.ndarray]] = {}
        # Documents of the global stream that reach the next row: (source, doc id, stream start, length).
        self._window: list[tuple[str, int, int, int]] = []
        self._pos = 0  # stream position of the next global row's first token
        self._end = 0  # stream position just past the last document pulled
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
        step = self._seq_len - 1  # each row starts with the previous row's last token
        while self._end < self._pos + (self.batch_size - 1) * step + self._seq_len:
            if not self._pull_document():
                raise StopIteration
        rows_per_rank = self.batch_size // self.num_data_ranks
        lo = self._pos + self.data_rank * rows_per_rank * step
        tokens, starts = self._read(lo, lo + (rows_per_rank - 1) * step + self._seq_len)
        rows = [(tokens[r * step : r * step + self._seq_len], starts[r * step : r * step + self._seq_len])
                for r in range(rows_per_rank)]
        self._pos += self.batch_size * step
        self._window = [d for d in self._window if d[2] + d[3] + 1 > self._pos]
        for per in self._docs.values():
            per.release()
        self.batches += 1
        return collate(rows)

    def _read(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Stream positions [lo, hi): tokens and document-start flags, reading only the documents there."""
        tokens = np.empty(hi - lo, dtype=np.int64)
        starts = np.zeros(hi - lo, dtype=bool)
        for name, i, start, length in self._window:
            if start + length + 1 <= lo or start >= hi:
                continue
            doc = np.concatenate([self._docs[name].doc(i).astype(np.int64), [self._eos]])
            a, b = max(start, lo), min(start + length + 1, hi)
            tokens[a - lo : b - lo] = doc[a - start : b - start]
            if start >= lo:
                starts[start - lo] = True
        return tokens, starts

    def _pull_document(self) -> bool:
        live = [n for n in self._docs if self.loop or self._epoch[n] == 0]
        if not live:
            return False
        name = min(live, key=lambda n: self._emitted[n] / self._weights[n])  # ties: config order
        docs = self._docs[name]
        i = int(self._permutation(name)[self._cursor[name]])
        length = docs.length(i)
        self._cursor[name] += 1
        if self._cursor[name] == len(docs):
            self._epoch[name] += 1
            self._cursor[name] = 0
        self._emitted[name] += length + 1
        self._window.append((name, i, self._end, length))
        self._end += length + 1
        return True

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
        """Stream position (JSON-serialisable, the same on every data rank); a loader restored from it
        yields the same next batches."""
        return {
            "version": STATE_VERSION,
            "corpus_key": self.corpus.key,
            "split": self.split,
            "batches": self.batches,
            "sources": {
                n: {"epoch": self._epoch[n], "cursor": self._cursor[n], "emitted": self._emitted[n]}
                for n in self._docs
            },
            "position": self._pos,
            "window": [[name, i, start] for name, i, start, _ in self._window],
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from state_dict(); the corpus, tokenizer and split must be the same (the data layout may
        differ: the position is global)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported loader state version {state.get('version')!r} (expected "
                             f"{STATE_VERSION}; states of older openk2 versions cannot be resumed)")
        if state["corpus_key"] != self.corpus.key or state["split"] != self.split:
            raise ValueError("loader state was saved for a different corpus, tokenizer or split")
        if set(state["sources"]) != set(self._docs):
            raise ValueError(
                f"loader state has sources {sorted(state['sources'])}, expected {sorted(self._docs)}"
            )
        for name, s in state["sources"].items():
            self._epoch[name], self._cursor[name], self._emitted[name] = s["epoch"], s["cursor"], s["emitted"]
        self._window = [(name, int(i), int(start), self._docs[name].length(int(i)))
                        for name, i, start in state["window"]]
        self._pos = int(state["position"])
        self._end = self._window[-1][2] + self._window[-1][3] + 1 if self._window else self._pos
        self.batches = state["batches"]
