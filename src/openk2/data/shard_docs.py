"""Reading token shards through memory maps: documents on demand, pages handed back after each batch."""

from __future__ import annotations

import hashlib
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from openk2.data.corpus import SPLITS, CorpusConfig
from openk2.data.shards import read_manifest, source_dir
from openk2.data.tokenizer import K2Tokenizer


class _Mapped:
    """A read-only memory map of one raw array file; `release` drops its pages from this process's RSS."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype = path, dtype
        self._map: mmap.mmap | None = None
        self._array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        """The file's contents as a read-only array (mapped on first use)."""
        if self._array is None:
            size = self.path.stat().st_size
            if size == 0:
                self._array = np.zeros(0, dtype=self.dtype)
            else:
                with open(self.path, "rb") as fh:
                    self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                self._array = np.frombuffer(self._map, dtype=self.dtype)
        return self._array

    def release(self) -> None:
        """Tell the kernel this process no longer needs the pages it touched (they stay in the page cache)."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)


class ShardDocs:
    """One split of one source, read from its shards: the same interface as corpus.TokenizedDocs."""

    def __init__(self, directory: Path, entry: dict, dtype: np.dtype, counts: Path) -> None:
        self._shards = [(_Mapped(directory / f"{s['file']}.bin", dtype),
                         _Mapped(directory / f"{s['file']}.idx", np.dtype(np.int64))) for s in entry["shards"]]
        self._first = np.array([s["first_doc"] for s in entry["shards"]] + [entry["docs"]], dtype=np.int64)
        self._num_docs, self._num_tokens, self._counts = entry["docs"], entry["tokens"], counts
        self._touched: set[int] = set()

    def __len__(self) -> int:
        return self._num_docs

    @property
    def num_tokens(self) -> int:
        """Total tokens over all documents (EOS not included)."""
        return self._num_tokens

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self._num_docs:
            raise IndexError(f"document {i} out of range for {self._num_docs} documents")
        k = int(np.searchsorted(self._first, i, side="right")) - 1
        self._touched.add(k)
        return k, i - int(self._first[k])

    def length(self, i: int) -> int:
        """Number of tokens of document i (reads only the index)."""
        k, j = self._locate(i)
        offsets = self._shards[k][1].array
        return int(offsets[j + 1] - offsets[j])

    def doc(self, i: int) -> np.ndarray:
        """Tokens of document i, copied out of the map."""
        k, j = self._locate(i)
        tokens, offsets = self._shards[k][0].array, self._shards[k][1].array
        return np.array(tokens[offsets[j] : offsets[j + 1]], dtype=np.int64)

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token id occurs over all documents: int64 [vocab_size] (counted by the writer)."""
        return np.load(self._counts)[0, :vocab_size]

    def first_token_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token id is a non-empty document's first token: int64 [vocab_size]."""
        return np.load(self._counts)[1, :vocab_size]

    def release(self) -> None:
        """Drop the pages of the shards read since the last release from this process's RSS."""
        for k in self._touched:
            for mapped in self._shards[k]:
                mapped.release()
        self._touched.clear()


@dataclass
class ShardCorpus:
    """Every source's train and validation documents, memory-mapped (like corpus.TokenizedCorpus)."""

    key: str
    docs: dict[str, dict[str, ShardDocs]]  # source name -> split -> documents


def open_shards(cfg: CorpusConfig, tokenizer: K2Tokenizer, shard_dir: str | Path | None = None) -> ShardCorpus:
    """Map the shards of every source with weight > 0; a missing or stale source is a ValueError."""
    root = shard_dir or cfg.shard_dir
    if root is None:
        raise ValueError("no shard directory: set data.shard_dir")
    docs: dict[str, dict[str, ShardDocs]] = {}
    h = hashlib.sha256(b"shards")
    for src in (s for s in cfg.sources if s.weight > 0):
        directory = source_dir(root, cfg, src, tokenizer)
        manifest = read_manifest(directory)
        if manifest is None:
            raise ValueError(f"no complete shards for source {src.name!r} under {root} (this tokenizer and "
                             "these settings); write them with `openk2 data tokenize --config FILE --out DIR`")
        dtype = np.dtype(manifest["dtype"])
        docs[src.name] = {split: ShardDocs(directory, manifest["splits"][split], dtype,
                                           directory / f"counts-{split}.npy") for split in SPLITS}
        h.update(f"\0{src.name}\0{manifest['fingerprint']}".encode())
    return ShardCorpus(h.hexdigest(), docs)
