"""Run set-up decisions: device, precision, the tokenizer a run uses and its token shards."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from openk2.data.corpus import tokenizer_training_texts
from openk2.data.shards import write_shards
from openk2.data.tokenizer import K2Tokenizer, train_tokenizer
from openk2.train.config import RunConfig


def resolve_device(name: str) -> torch.device:
    """`auto` picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device is cuda but no CUDA device is available")
    return device


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX or AVX512-BF16); AVX2 CPUs run bf16 GEMMs 5-20x slower."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    return "AMX" in capability or "BF16" in capability


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype (None = fp32). Master weights and optimizer state stay fp32 either way."""
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    fast = device.type == "cuda" or (device.type == "cpu" and cpu_has_fast_bf16())
    return torch.bfloat16 if fast else None


def prepare_tokenizer(cfg: RunConfig, out_dir: Path, resume_from: Path | None) -> K2Tokenizer:
    """The run's tokenizer: from the checkpoint when resuming, a configured path, the run dir, or trained now."""
    if cfg.tokenizer.path is not None and not Path(cfg.tokenizer.path).exists():
        raise ValueError(f"tokenizer.path {cfg.tokenizer.path} does not exist")
    candidates = [Path(c) for c in (resume_from, cfg.tokenizer.path, out_dir / "tokenizer") if c is not None]
    found = next((c for c in candidates if (c / "tokenizer.json").is_file() or (c.suffix == ".json" and c.is_file())),
                 None)
    if found is not None:
        tok = K2Tokenizer.load(found)
    else:
        start = time.perf_counter()
        texts = tokenizer_training_texts(cfg.data, cfg.tokenizer.train_chars)
        tok = train_tokenizer(texts, cfg.model.vocab_size)
        tok.save(out_dir / "tokenizer")
        print(f"trained a {tok.vocab_size}-token BPE tokenizer in {time.perf_counter() - start:.1f}s "
              f"-> {out_dir / 'tokenizer'}", file=sys.stderr)
    if tok.vocab_size != cfg.model.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens but model.vocab_size is {cfg.model.vocab_size}")
    return tok


def prepare_shards(cfg: RunConfig, tokenizer: K2Tokenizer) -> None:
    """Write the run's token shards (data.shard_dir) for sources that lack them; nothing when unset or done."""
    if cfg.data.shard_dir is None:
        return
    start = time.perf_counter()
    reports = write_shards(cfg.data, tokenizer)
    written = sum(r.written for r in reports)
    if written:
        print(f"wrote {written} token shards under {cfg.data.shard_dir} in {time.perf_counter() - start:.1f}s",
              file=sys.stderr)
