"""Pre-tokenised token shards on disk: written once per source, resumable, fingerprinted.

Layout of `shard_dir/<source name>-<key>/` (key: the first 16 hex digits of `config_key`):

    train-00000.bin   tokens of whole documents, raw uint16 (vocab <= 65536) or uint32, memory-mappable
    train-00000.idx   raw int64 document offsets into that .bin (docs + 1 entries, starting at 0)
    counts-train.npy  int64 [2, vocab]: token counts and first-token counts (for the unigram baseline)
    manifest.json     written last: the source is complete

A shard is closed before the document that would take it past `shard_tokens` (a longer document gets a
shard of its own), so documents never straddle shards and the shards of a split hold its documents in
order. Every file is written to a temporary name and renamed, the .idx after its .bin, so a killed writer
leaves only whole shards behind; the next run keeps those, skips their documents without tokenising them,
and continues. `config_key` hashes what decides the tokens without reading any text (tokenizer, the
source's settings, seed, doc_chars, val_fraction, and for files their sizes and mtimes); `fingerprint`
additionally hashes the documents themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from openk2.data.corpus import SPLITS, CorpusConfig, source_documents
from openk2.data.sources import FILE_KINDS, SourceConfig, _files
from openk2.data.tokenizer import K2Tokenizer

SHARD_VERSION = 1
DEFAULT_SHARD_TOKENS = 1 << 24  # 16M tokens: 32 MB of uint16 per shard
ENCODE_CHUNK = 64  # documents tokenised per encode_batch call (their ids are Python lists until written)


@dataclass(frozen=True)
class WriteReport:
    """What write_shards did for one source."""

    name: str
    directory: Path
    written: int  # shards written by this call
    kept: int  # shards found finished and left alone
    skipped: bool  # the source was already complete (manifest present and current)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _file_stats(src: SourceConfig) -> list[list]:
    if src.kind not in FILE_KINDS:
        return []
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in _files(src)]


def _provenance(src: SourceConfig) -> str:
    # Bundled text comes from the installed Python (stdlib) or data package; generated math from the seed.
    if src.kind == "python-stdlib":
        return f"{sys.version}:{sysconfig.get_paths()['stdlib']}"
    return ""


def config_key(cfg: CorpusConfig, src: SourceConfig, tokenizer: K2Tokenizer) -> str:
    """Hash of everything that decides a source's shards, computed without reading its text."""
    settings = {k: v for k, v in src.to_dict().items() if k != "weight"}
    parts = [f"v{SHARD_VERSION}", tokenizer.fingerprint, json.dumps(settings, sort_keys=True),
             f"{cfg.seed}:{cfg.doc_chars}:{cfg.val_fraction!r}", _provenance(src),
             json.dumps(_file_stats(src))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def source_dir(shard_dir: str | Path, cfg: CorpusConfig, src: SourceConfig, tokenizer: K2Tokenizer) -> Path:
    """Where a source's shards live for this tokenizer and these settings."""
    return Path(shard_dir) / f"{src.name}-{config_key(cfg, src, tokenizer)[:16]}"


def read_manifest(directory: Path) -> dict | None:
    """The manifest of a complete source directory, or None if the source is not (yet) complete."""
    path = directory / "manifest.json"
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    return manifest if manifest.get("version") == SHARD_VERSION else None


def content_fingerprint(key: str, texts: dict[str, list[str]]) -> str:
    """Hash of the config key and every document of each split."""
    h = hashlib.sha256(key.encode())
    for split in SPLITS:
        h.update(f"\0{split}\0{len(texts[split])}".encode())
        for doc in texts[split]:
            h.update(doc.encode("utf-8", "surrogatepass"))
            h.update(b"\0")
    return h.hexdigest()


def write_shards(cfg: CorpusConfig, tokenizer: K2Tokenizer, shard_dir: str | Path | None = None,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS, verify: bool = False) -> list[WriteReport]:
    """Tokenise every source with weight > 0 into `shard_dir` (default `cfg.shard_dir`), one source at a
    time. Complete sources are skipped unread unless `verify` re-reads their text and rewrites them when it
    changed; a partial source continues after its last whole shard."""
    out = shard_dir or cfg.shard_dir
    if out is None:
        raise ValueError("no shard directory: set data.shard_dir or pass --out")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    return [_write_source(cfg, src, tokenizer, Path(out), shard_tokens, verify)
            for src in cfg.sources if src.weight > 0]


def _write_source(cfg: CorpusConfig, src: SourceConfig, tokenizer: K2Tokenizer, out: Path, shard_tokens: int,
                  verify: bool) -> WriteReport:
    key = config_key(cfg, src, tokenizer)
    directory = out / f"{src.name}-{key[:16]}"
    done = read_manifest(directory)
    if done is not None and not verify:
        return WriteReport(src.name, directory, 0, sum(len(done["splits"][s]["shards"]) for s in SPLITS), True)
    texts = source_documents(cfg, src)
    fingerprint = content_fingerprint(key, texts)
    if done is not None and done["fingerprint"] == fingerprint:
        return WriteReport(src.name, directory, 0, sum(len(done["splits"][s]["shards"]) for s in SPLITS), True)
    directory.mkdir(parents=True, exist_ok=True)
    progress = directory / "progress.json"
    if done is not None or (progress.is_file() and json.loads(progress.read_text()) != {"fingerprint": fingerprint}):
        for f in directory.iterdir():  # other text under the same settings: start over
            f.unlink()
    for f in directory.glob("*.tmp*"):  # half-written files of a killed writer
        f.unlink()
    _atomic_write(progress, json.dumps({"fingerprint": fingerprint}).encode())
    dtype = token_dtype(tokenizer.vocab_size)
    splits, written, kept = {}, 0, 0
    for split in SPLITS:
        shards, w = _write_split(directory, split, texts[split], tokenizer, dtype, shard_tokens)
        written, kept = written + w, kept + len(shards) - w
        counts = _count_tokens(directory, shards, dtype, tokenizer.vocab_size)
        np.save(directory / f"counts-{split}.npy.tmp{os.getpid()}.npy", counts)
        os.replace(directory / f"counts-{split}.npy.tmp{os.getpid()}.npy", directory / f"counts-{split}.npy")
        splits[split] = {"docs": len(texts[split]), "tokens": sum(s["tokens"] for s in shards), "shards": shards}
    manifest = {"version": SHARD_VERSION, "name": src.name, "config_key": key, "fingerprint": fingerprint,
                "tokenizer": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size, "dtype": dtype.name,
                "source": src.to_dict(), "shard_tokens": shard_tokens, "splits": splits}
    _atomic_write(directory / "manifest.json", json.dumps(manifest, indent=1).encode())
    progress.unlink(missing_ok=True)
    return WriteReport(src.name, directory, written, kept, False)


def _write_split(directory: Path, split: str, docs: list[str], tokenizer: K2Tokenizer, dtype: np.dtype,
                 shard_tokens: int) -> tuple[list[dict], int]:
    """Write (or keep) the shards of one split; returns their entries and how many were written now."""
    shards: list[dict] = []
    first = 0
    while (directory / f"{split}-{len(shards):05d}.idx").is_file():  # whole shards of an earlier run
        name = f"{split}-{len(shards):05d}"
        offsets = np.fromfile(directory / f"{name}.idx", dtype=np.int64)
        shards.append({"file": name, "first_doc": first, "docs": len(offsets) - 1, "tokens": int(offsets[-1])})
        first += len(offsets) - 1
    kept = len(shards)
    pending: list[np.ndarray] = []
    pending_tokens = 0
    for lo in range(first, len(docs), ENCODE_CHUNK):
        for ids in tokenizer.encode_batch(docs[lo : lo + ENCODE_CHUNK]):
            if pending and pending_tokens + len(ids) > shard_tokens:
                shards.append(_flush(directory, split, len(shards), first, pending, dtype))
                first, pending, pending_tokens = first + len(pending), [], 0
            pending.append(np.asarray(ids, dtype=dtype))
            pending_tokens += len(ids)
    if pending:
        shards.append(_flush(directory, split, len(shards), first, pending, dtype))
    return shards, len(shards) - kept


def _flush(directory: Path, split: str, index: int, first: int, docs: list[np.ndarray], dtype: np.dtype) -> dict:
    name = f"{split}-{index:05d}"
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    _atomic_write(directory / f"{name}.bin", np.concatenate(docs).astype(dtype).tobytes())
    _atomic_write(directory / f"{name}.idx", offsets.tobytes())  # last: its presence marks the shard whole
    return {"file": name, "first_doc": first, "docs": len(docs), "tokens": int(offsets[-1])}


def _count_tokens(directory: Path, shards: list[dict], dtype: np.dtype, vocab_size: int) -> np.ndarray:
    counts = np.zeros((2, vocab_size), dtype=np.int64)
    for s in shards:
        tokens = np.fromfile(directory / f"{s['file']}.bin", dtype=dtype)
        offsets = np.fromfile(directory / f"{s['file']}.idx", dtype=np.int64)
        counts[0] += np.bincount(tokens, minlength=vocab_size)
        starts = offsets[:-1][np.diff(offsets) > 0]
        counts[1] += np.bincount(tokens[starts], minlength=vocab_size)
    return counts


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
