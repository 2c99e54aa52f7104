"""Process memory of streaming token shards vs the in-RAM corpus, at several synthetic corpus sizes.

For each size (MB of UTF-8 text) the script writes a seeded synthetic JSONL corpus (Zipf-distributed random
words, documents of 1-8 KB), trains one small BPE tokenizer on the first size's first 1 MB (shared by all
sizes), then runs three fresh processes and reads /proc/self/status in each:

* write:  `write_shards` (what `openk2 data tokenize` does); peak RSS (VmHWM) and wall time.
* stream: `PackedLoader` over the shards (`data.shard_dir`), rank 0 of `--ranks` data ranks, iterated over
          one whole epoch of the corpus' training tokens; RSS (VmRSS, and its RssAnon / RssFile parts) after
          the first batch and its maximum over the epoch (sampled every 50 batches), and batches/s.
* ram:    the same loader without shards (the whole corpus tokenised into RAM, as before); RSS after the
          first batch.

Usage:
  python benchmarks/bench_streaming_data.py --sizes 10 100 --ranks 1 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """A JSONL file of about `megabytes` MB of text; returns its text bytes."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(5000)]
    p = 1.0 / np.arange(1, len(words) + 1)
    p /= p.sum()
    total, target = 0, int(megabytes * 1e6)
    with path.open("w") as fh:
        while total < target:
            n = int(rng.integers(150, 1200))
            text = " ".join(words[i] for i in rng.choice(len(words), size=n, p=p)) + ".\n"
            fh.write(json.dumps({"text": text}) + "\n")
            total += len(text)
    return total


def _config(corpus: Path, shard_dir: Path | None, seq_len: int):
    from openk2.data.corpus import CorpusConfig

    return CorpusConfig.from_dict({"seq_len": seq_len, "val_fraction": 0.01, "doc_chars": 8192,
                                   "shard_dir": str(shard_dir) if shard_dir else None,
                                   "sources": [{"kind": "jsonl", "name": "synthetic", "path": str(corpus)}]})


def phase(args: argparse.Namespace) -> dict:
    """One measurement in this (fresh) process."""
    from openk2.data.loader import PackedLoader
    from openk2.data.shards import write_shards
    from openk2.data.tokenizer import K2Tokenizer

    tok = K2Tokenizer.load(args.tokenizer)
    base = status()
    start = time.perf_counter()
    if args.phase == "write":
        write_shards(_config(args.corpus, args.shards, args.seq_len), tok)
        return {"seconds": time.perf_counter() - start, "base": base, "end": status()}
    cfg = _config(args.corpus, args.shards if args.phase == "stream" else None, args.seq_len)
    loader = PackedLoader(cfg, tok, args.batch_size, data_rank=0, num_data_ranks=args.ranks[0])
    next(loader)
    first = status()
    if args.phase == "ram":
        return {"seconds": time.perf_counter() - start, "base": base, "first": first}
    epoch_tokens = sum(d["train"].num_tokens + len(d["train"]) for d in loader.corpus.docs.values())
    batches = epoch_tokens // (args.batch_size * (args.seq_len - 1))
    peak = dict(first)
    t0 = time.perf_counter()
    for i in range(batches):
        next(loader)
        if i % 50 == 0:
            peak = {k: max(peak[k], v) for k, v in status().items()}
    seconds = time.perf_counter() - t0
    return {"batches": batches, "batches_per_s": batches / seconds, "base": base, "first": first, "peak": peak,
            "end": status(), "epochs": loader.epochs}


def main() -> None:
    """Run every size and phase in fresh processes and print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[10, 100], help="corpus sizes in MB of text")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4], help="data ranks (rank 0 measured)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/openk2-bench-streaming"))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--skip-ram", action="store_true", help="skip the in-RAM comparison")
    parser.add_argument("--phase", choices=["write", "stream", "ram"], help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--shards", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args)))
        return
    from openk2.data.tokenizer import train_tokenizer

    args.work.mkdir(parents=True, exist_ok=True)
    tok_dir = args.work / "tokenizer"
    mb = 1 / 1e6
    for size in args.sizes:
        corpus = args.work / f"corpus-{size:g}MB.jsonl"
        text_bytes = write_corpus(corpus, size) if not corpus.exists() else int(size * 1e6)
        if not (tok_dir / "tokenizer.json").exists():
            sample = [json.loads(line)["text"] for line in corpus.open().readlines()[:300]]
            train_tokenizer(sample, 4096).save(tok_dir)
        shards = args.work / f"shards-{size:g}MB"

        def run(name: str, ranks: int = 1, corpus=corpus, shards=shards) -> dict:
            cmd = [sys.executable, __file__, "--phase", name, "--corpus", str(corpus), "--shards", str(shards),
                   "--tokenizer", str(tok_dir), "--batch-size", str(args.batch_size), "--seq-len",
                   str(args.seq_len), "--ranks", str(ranks)]
            return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

        shutil.rmtree(shards, ignore_errors=True)  # time a fresh write
        w = run("write")
        shard_bytes = sum(f.stat().st_size for f in shards.rglob("*.bin"))
        print(f"{size:g} MB text ({text_bytes * mb:.0f} MB): write {w['seconds']:.1f}s, writer peak RSS "
              f"{w['end']['VmHWM'] * mb:.0f} MB (start {w['base']['VmRSS'] * mb:.0f} MB), "
              f"shards {shard_bytes * mb:.1f} MB")
        for ranks in args.ranks:
            s = run("stream", ranks)
            print(f"  stream rank 0/{ranks}: {s['batches']} batches ({s['batches_per_s']:.0f}/s), RSS after first "
                  f"batch {s['first']['VmRSS'] * mb:.0f} MB (anon {s['first']['RssAnon'] * mb:.0f}, file "
                  f"{s['first']['RssFile'] * mb:.0f}), max over the epoch {s['peak']['VmRSS'] * mb:.0f} MB (anon "
                  f"{s['peak']['RssAnon'] * mb:.0f}, file {s['peak']['RssFile'] * mb:.0f}); epochs {s['epochs']}")
        if not args.skip_ram:
            r = run("ram")
            print(f"  in-RAM loader: RSS after first batch {r['first']['VmRSS'] * mb:.0f} MB (anon "
                  f"{r['first']['RssAnon'] * mb:.0f}), {r['seconds']:.1f}s to first batch")


if __name__ == "__main__":
    main()
