"""Corpus configuration, document chunking, train/validation split and cached tokenisation."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from openk2.configfile import check_table, config_errors, read_toml, table_errors
from openk2.data.sources import SourceConfig, read_documents
from openk2.data.tokenizer import K2Tokenizer

SPLITS = ("train", "val")
CACHE_VERSION = 1


def default_sources() -> list[SourceConfig]:
    """The built-in mixture: English verse and prose, Python code, worked arithmetic."""
    return [
        SourceConfig(kind="shakespeare", weight=0.4),
        SourceConfig(kind="python-stdlib", weight=0.3),
        SourceConfig(kind="math", weight=0.3),
    ]


@dataclass(frozen=True)
class CorpusConfig:
    """Sources with mixture weights, packing length and the validation split."""

    sources: list[SourceConfig] = field(default_factory=default_sources)
    seq_len: int = 256  # tokens per packed row
    val_fraction: float = 0.02  # share of each source's documents held out for validation
    seed: int = 0
    doc_chars: int = 8192  # longer texts are cut at blank lines into documents of at most this size
    cache_dir: str | None = None  # optional on-disk token cache (the whole corpus in RAM while training)
    shard_dir: str | None = None  # stream memory-mapped token shards from here (written there when missing)

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("corpus needs at least one source")
        names = [s.name for s in self.sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"source names must be unique; repeated: {dupes} (set `name` to tell them apart)"
            )
        if not any(s.weight > 0 for s in self.sources):
            raise ValueError("at least one source needs a positive weight")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {self.seq_len}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.doc_chars < 1:
            raise ValueError(f"doc_chars must be positive, got {self.doc_chars}")

    @classmethod
    def from_dict(cls, d: dict) -> CorpusConfig:
        """Build from a plain dict such as a TOML `[data]` table; unknown keys raise ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown corpus config keys {unknown}; allowed: {sorted(known)}")
        kw = dict(d)
        if "sources" in kw:
            if not isinstance(kw["sources"], list | tuple):
                raise ValueError("'sources' must be a list of source tables ([[data.sources]] in TOML)")
            kw["sources"] = [
                s if isinstance(s, SourceConfig) else SourceConfig.from_dict(s) for s in kw["sources"]
            ]
        return cls(**kw)

    def to_dict(self) -> dict:
        """Plain-dict form (inverse of from_dict)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["sources"] = [s.to_dict() for s in self.sources]
        return d

    @property
    def weights(self) -> dict[str, float]:
        """Mixture weights normalised to sum to one."""
        total = sum(s.weight for s in self.sources)
        return {s.name: s.weight / total for s in self.sources}


def default_corpus_config() -> CorpusConfig:
    """The built-in corpus with default settings."""
    return CorpusConfig()


def load_corpus_config(path: str | Path) -> CorpusConfig:
    """Read a TOML file (`base = "..."` inherits): its `[data]` table if present, else the whole file. A bad key
    or value is a ValueError naming it and the file."""
    d = read_toml(path)
    table = d.get("data", d)
    with config_errors(path):
        check_table(CorpusConfig, "data", table)
        with table_errors("data"):
            return CorpusConfig.from_dict(table)


def chunk_text(text: str, max_chars: int) -> list[str]:
    """Cut `text` into pieces of at most `max_chars`, breaking at blank lines, then newlines (lossless)."""
    if len(text) <= max_chars:
        return [text] if text else []
    chunks: list[str] = []
    current = ""
    for piece in _split_keep(text, "\n\n", max_chars):
        if current and len(current) + len(piece) > max_chars:
            chunks.append(current)
            current = ""
        current += piece
    if current:
        chunks.append(current)
    return chunks


def _split_keep(text: str, sep: str, max_chars: int) -> list[str]:
    # Pieces end with `sep`; any piece still too long is split at the next finer separator.
    parts = text.split(sep)
    pieces = [p + sep for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    out: list[str] = []
    for p in pieces:
        if len(p) <= max_chars:
            out.append(p)
        elif sep == "\n\n":
            out.extend(_split_keep(p, "\n", max_chars))
        else:
            out.extend(p[i : i + max_chars] for i in range(0, len(p), max_chars))
    return out


def split_documents(docs: list[str], val_fraction: float, seed: int, name: str) -> dict[str, list[str]]:
    """Deterministic split by document: a seeded choice of round(n * val_fraction) documents (>= 1 if any)."""
    n = len(docs)
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)  # keep both splits non-empty
    order = list(range(n))
    random.Random(f"openk2-split:{seed}:{name}").shuffle(order)
    val = set(order[:n_val])
    return {
        "train": [d for i, d in enumerate(docs) if i not in val],
        "val": [d for i, d in enumerate(docs) if i in val],
    }


def corpus_documents(cfg: CorpusConfig) -> dict[str, dict[str, list[str]]]:
    """Deduplicated documents of each source with weight > 0: {name: {"train": [...], "val": [...]}}."""
    return {src.name: source_documents(cfg, src) for src in cfg.sources if src.weight > 0}


def source_documents(cfg: CorpusConfig, src: SourceConfig) -> dict[str, list[str]]:
    """One source's deduplicated documents, split: {"train": [...], "val": [...]}."""
    docs = [c for d in read_documents(src, cfg.seed) for c in chunk_text(d, cfg.doc_chars)]
    docs = list(dict.fromkeys(docs))  # drop exact duplicates so no text sits in both splits
    return split_documents(docs, cfg.val_fraction, cfg.seed, src.name)


def tokenizer_training_texts(cfg: CorpusConfig, max_chars: int) -> list[str]:
    """Training-split documents for fitting a tokenizer, about `max_chars` in all, shared out by weight."""
    docs = corpus_documents(cfg)
    texts: list[str] = []
    for name, per in docs.items():
        budget = cfg.weights[name] * max_chars
        for doc in per["train"]:
            if budget <= 0:
                break
            texts.append(doc)
            budget -= len(doc)
    return texts


@dataclass
class TokenizedDocs:
    """Documents as a flat int32 token array plus offsets: doc i is tokens[offsets[i]:offsets[i+1]]."""

    tokens: np.ndarray
    offsets: np.ndarray

    @classmethod
    def from_lists(cls, docs: list[list[int]]) -> TokenizedDocs:
        """Pack token lists into the flat form."""
        lengths = np.array([len(d) for d in docs], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = (
            np.concatenate([np.asarray(d, dtype=np.int32) for d in docs]) if docs else np.zeros(0, np.int32)
        )
        return cls(flat, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def doc(self, i: int) -> np.ndarray:
        """Tokens of document i."""
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def length(self, i: int) -> int:
        """Number of tokens of document i."""
        return int(self.offsets[i + 1] - self.offsets[i])

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token id occurs over all documents: int64 [vocab_size]."""
        return np.bincount(self.tokens, minlength=vocab_size).astype(np.int64)

    def first_token_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token id is a non-empty document's first token: int64 [vocab_size]."""
        starts = self.offsets[:-1][np.diff(self.offsets) > 0]
        return np.bincount(self.tokens[starts], minlength=vocab_size).astype(np.int64)

    def release(self) -> None:
        """Nothing to release: the tokens live in RAM (memory-mapped shards drop their pages here)."""

    @property
    def num_tokens(self) -> int:
        """Total tokens over all documents (EOS not included)."""
        return int(self.offsets[-1])


@dataclass
class TokenizedCorpus:
    """Token ids of every source's train and validation documents."""

    key: str
    docs: dict[str, dict[str, TokenizedDocs]]  # source name -> split -> documents


_MEMO: dict[str, TokenizedCorpus] = {}
_MEMO_SIZE = 4


def tokenize_corpus(cfg: CorpusConfig, tokenizer: K2Tokenizer) -> TokenizedCorpus:
    """Tokenise the corpus, memoised in memory and, with `cfg.cache_dir`, on disk."""
    # Weights, seq_len and cache_dir do not change the tokens, so they stay out of the memo key.
    text_cfg = {k: v for k, v in cfg.to_dict().items() if k not in ("seq_len", "cache_dir", "shard_dir")}
    text_cfg["sources"] = [
        {k: v for k, v in s.items() if k != "weight"} for s in text_cfg["sources"] if s["weight"] > 0
    ]
    memo_key = _hash(tokenizer.fingerprint, json.dumps(text_cfg, sort_keys=True))
    if memo_key in _MEMO:
        return _MEMO[memo_key]
    texts = corpus_documents(cfg)
    # The disk key hashes the text itself, so edited user files never hit a stale cache.
    h = hashlib.sha256(f"v{CACHE_VERSION}:{tokenizer.fingerprint}".encode())
    for name in sorted(texts):
        for split in SPLITS:
            h.update(f"\0{name}\0{split}\0{len(texts[name][split])}".encode())
            for doc in texts[name][split]:
                h.update(doc.encode("utf-8", "surrogatepass"))
                h.update(b"\0")
    key = h.hexdigest()
    corpus = _load_cache(cfg.cache_dir, key, texts) if cfg.cache_dir else None
    if corpus is None:
        docs = {
            name: {split: TokenizedDocs.from_lists(tokenizer.encode_batch(per[split])) for split in SPLITS}
            for name, per in texts.items()
        }
        corpus = TokenizedCorpus(key, docs)
        if cfg.cache_dir:
            _save_cache(cfg.cache_dir, corpus)
    if len(_MEMO) >= _MEMO_SIZE:
        _MEMO.pop(next(iter(_MEMO)))
    _MEMO[memo_key] = corpus
    return corpus


def _hash(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _cache_path(cache_dir: str, key: str) -> Path:
    return Path(cache_dir) / f"tokens-{key[:32]}.npz"


def _save_cache(cache_dir: str, corpus: TokenizedCorpus) -> None:
    path = _cache_path(cache_dir, corpus.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for i, per in enumerate(corpus.docs.values()):
        for split, td in per.items():
            arrays[f"{i}-{split}-tokens"], arrays[f"{i}-{split}-offsets"] = td.tokens, td.offsets
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)  # atomic, so a crash never leaves a half-written cache behind


def _load_cache(cache_dir: str, key: str, texts: dict[str, dict[str, list[str]]]) -> TokenizedCorpus | None:
    path = _cache_path(cache_dir, key)
    if not path.exists():
        return None
    with np.load(path) as data:
        docs = {
            name: {
                split: TokenizedDocs(data[f"{i}-{split}-tokens"], data[f"{i}-{split}-offsets"])
                for split in SPLITS
            }
            for i, name in enumerate(texts)
        }
    return TokenizedCorpus(key, docs)
