"""`openk2 tokenizer train`: fit K2's byte-level BPE (with its special-token block) on the corpus mixture."""

from __future__ import annotations

import argparse
import time

from openk2.data.tokenizer import K2_NUM_SPECIAL_SLOTS, train_tokenizer


def tokenizer_main(argv: list[str] | None = None) -> int:
    """`openk2 tokenizer train --vocab-size N --out DIR [--corpus-config FILE]`: train and save."""
    from openk2.data.corpus import default_corpus_config, load_corpus_config, tokenizer_training_texts

    parser = argparse.ArgumentParser(
        prog="openk2 tokenizer", description="Byte-level BPE with K2 special tokens"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a tokenizer on the corpus mixture and save it")
    train.add_argument("--vocab-size", type=int, default=4096, help="total ids, special block included")
    train.add_argument("--out", required=True, help="output directory")
    train.add_argument("--corpus-config", help="TOML file with a [data] table (default: built-in mixture)")
    train.add_argument("--max-chars", type=int, default=4_000_000, help="characters of training text")
    train.add_argument("--num-special", type=int, default=K2_NUM_SPECIAL_SLOTS, help="special slots")
    args = parser.parse_args(argv)
    cfg = load_corpus_config(args.corpus_config) if args.corpus_config else default_corpus_config()
    start = time.perf_counter()
    texts = tokenizer_training_texts(cfg, args.max_chars)
    tok = train_tokenizer(texts, args.vocab_size, args.num_special)
    out = tok.save(args.out)
    chars = sum(len(t) for t in texts)
    print(
        f"trained vocab {tok.vocab_size} ({tok.num_base_tokens} BPE + {tok.vocab_size - tok.num_base_tokens}"
        f" special) on {chars:,} chars in {time.perf_counter() - start:.1f}s -> {out}"
    )
    return 0
