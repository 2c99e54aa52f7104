"""Unigram cross-entropy baseline: the loss a model that ignores context would reach."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from openk2.data.corpus import TokenizedDocs
from openk2.data.loader import PackedLoader
from openk2.data.shard_docs import ShardDocs


def unigram_baseline(
    data: PackedLoader | Sequence[int] | np.ndarray,
    val_tokens: Sequence[int] | np.ndarray | None = None,
    vocab_size: int | None = None,
    alpha: float = 1.0,
) -> float:
    """Cross-entropy (nats/token) on validation tokens of an add-`alpha` unigram fitted on training tokens.

    Given a PackedLoader, it scores exactly the loader's targets: the mixture of the sources' training
    unigrams (by weight) on each source's validation documents (EOS included, first tokens excluded),
    averaged by weight. Given raw token sequences, it fits on `data` and scores `val_tokens`.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    if isinstance(data, PackedLoader):
        return _loader_baseline(data, alpha)
    if val_tokens is None:
        raise ValueError("val_tokens are required when fitting on a token sequence")
    train, val = np.asarray(data, dtype=np.int64), np.asarray(val_tokens, dtype=np.int64)
    if len(train) == 0 or len(val) == 0:
        raise ValueError("need non-empty train and val tokens")
    vocab = vocab_size or int(max(train.max(), val.max())) + 1
    probs = _smoothed(np.bincount(train, minlength=vocab), alpha)
    return float(-np.log(probs[val]).mean())


def _smoothed(counts: np.ndarray, alpha: float) -> np.ndarray:
    counts = counts.astype(np.float64) + alpha
    return counts / counts.sum()


def _target_counts(docs: TokenizedDocs | ShardDocs, vocab: int, eos_id: int) -> np.ndarray:
    # Every token a packed row trains on: all but each document's first token, plus one EOS per document.
    counts = docs.token_counts(vocab) - docs.first_token_counts(vocab)
    counts[eos_id] += len(docs)
    return counts


def _loader_baseline(loader: PackedLoader, alpha: float) -> float:
    vocab, eos = loader.tokenizer.vocab_size, loader.tokenizer.eos_id
    weights = loader.config.weights
    live = list(loader.corpus.docs)  # the corpus holds only sources with weight > 0
    probs = np.zeros(vocab)
    total_w = sum(weights[n] for n in live if len(loader.corpus.docs[n]["train"]))
    for name in live:
        train = loader.corpus.docs[name]["train"]
        if len(train):
            counts = train.token_counts(vocab)
            counts[eos] += len(train)
            probs += weights[name] / total_w * _smoothed(counts, alpha)
    scored = [(weights[n], _target_counts(loader.corpus.docs[n]["val"], vocab, eos)) for n in live]
    scored = [(w, c) for w, c in scored if c.sum()]
    if not scored or total_w == 0:
        raise ValueError("the unigram baseline needs training and validation documents (val_fraction > 0)")
    val_w = sum(w for w, _ in scored)
    return float(sum(w / val_w * -(c * np.log(probs)).sum() / c.sum() for w, c in scored))
