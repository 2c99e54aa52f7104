"""`openk2 data tokenize`: write a run's corpus as memory-mapped token shards, once (resumable)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def data_main(argv: list[str] | None = None) -> int:
    """`openk2 data tokenize --config FILE [--out DIR] [--tokenizer PATH] [--verify]`: write the shards."""
    from openk2.data.shards import DEFAULT_SHARD_TOKENS, read_manifest, write_shards
    from openk2.data.tokenizer import K2Tokenizer
    from openk2.train.config import load_run_config

    parser = argparse.ArgumentParser(prog="openk2 data", description="Pre-tokenised token shards")
    sub = parser.add_subparsers(dest="command", required=True)
    tok = sub.add_parser("tokenize", help="tokenise the run config's [data] sources into shards")
    tok.add_argument("--config", required=True, help="run config (TOML) whose [data] table names the sources")
    tok.add_argument("--out", help="shard directory (default: data.shard_dir of the config)")
    tok.add_argument("--tokenizer", help="saved tokenizer (default: tokenizer.path of the config)")
    tok.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard at most")
    tok.add_argument("--verify", action="store_true",
                     help="re-read complete sources and rewrite those whose text changed")
    tok.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = parser.parse_args(argv)
    cfg = load_run_config(args.config, args.set)
    out = args.out or cfg.data.shard_dir
    if out is None:
        raise ValueError("no shard directory: pass --out DIR or set data.shard_dir in the config")
    path = args.tokenizer or cfg.tokenizer.path
    if path is None:
        raise ValueError("a tokenizer is needed: pass --tokenizer DIR or set tokenizer.path in the config "
                         "(the shards must be written with the tokenizer the run trains with)")
    if not Path(path).exists():
        raise ValueError(f"tokenizer {path} does not exist")
    tokenizer = K2Tokenizer.load(path)
    start = time.perf_counter()
    for r in write_shards(cfg.data, tokenizer, out, args.shard_tokens, args.verify):
        manifest = read_manifest(r.directory) or {"splits": {}}
        sizes = ", ".join(f"{s} {v['docs']:,} docs {v['tokens']:,} tokens" for s, v in manifest["splits"].items())
        state = "up to date" if r.skipped else f"{r.written} shards written, {r.kept} kept"
        print(f"{r.name}: {state}; {sizes} -> {r.directory}")
    print(f"done in {time.perf_counter() - start:.1f}s; train with data.shard_dir = \"{out}\"")
    return 0
