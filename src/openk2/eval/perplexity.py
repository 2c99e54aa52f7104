"""Token-level perplexity of a local checkpoint on the validation split of our pre-training corpus.

The windows are exactly the rows the pre-trainer's validation loss sees (`openk2.train.trainer.Trainer.evaluate`):
`PackedLoader(corpus, tokenizer, split="val", loop=False)` packs the held-out documents of each source (EOS
after each, mixture by weight, consecutive rows sharing one token) into rows of `corpus.seq_len` tokens, and
the model scores every next-token target that is not a document's first token. Sample i is the i-th row.
Each sample's score is its summed negative log-likelihood (nats) with its token count in `detail["tokens"]`;
`aggregate` pools them into exp(total NLL / total tokens), the perplexity of the windows as one text, with a
seeded bootstrap interval over windows.

It needs the model's logits, so only a `LocalChatModel` (`local:DIR`) can be scored. Any other model gets a
`Verdict` with a NaN score and `detail["error"]` (evaluate never raises for the model it is given), and the
aggregate is then NaN.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openk2.data.corpus import CorpusConfig, load_corpus_config
from openk2.eval.base import Aggregate, Benchmark, EvalContext, Sample, Verdict
from openk2.llm.base import ChatModel

NOT_LOCAL = "perplexity needs a local checkpoint (local:DIR): it reads the model's logits"


def resolve_corpus(corpus: CorpusConfig | dict | str | Path | None) -> CorpusConfig:
    """A corpus config from a config object, a `[data]`-shaped dict, a TOML run config (its `[data]` table),
    a run directory's `run_config.json`, or None for the built-in mixture (that of configs/tiny.toml)."""
    if corpus is None:
        return CorpusConfig()
    if isinstance(corpus, CorpusConfig):
        return corpus
    if isinstance(corpus, dict):
        return CorpusConfig.from_dict(corpus)
    path = Path(corpus)
    if not path.is_file():
        raise ValueError(f"corpus config {path} does not exist")
    if path.suffix == ".json":
        raw = json.loads(path.read_text())
        return CorpusConfig.from_dict(raw.get("data", raw))
    return load_corpus_config(path)


class PerplexityBenchmark(Benchmark):
    """`windows` validation rows of `corpus` (see `resolve_corpus`), each `seq_len` tokens (default: the
    corpus config's, 256 for the built-in one); `bootstrap` resamples for the interval, drawn with `seed`."""

    name = "perplexity"
    description = "perplexity of a local checkpoint on the corpus's validation windows (lower is better)"
    metric = "perplexity"
    binary = False
    higher_is_better = False

    def __init__(self, corpus: CorpusConfig | dict | str | Path | None = None, windows: int = 64,
                 seq_len: int | None = None, bootstrap: int = 1000, seed: int = 0) -> None:
        if windows < 1:
            raise ValueError(f"windows must be >= 1, got {windows}")
        if bootstrap < 0:
            raise ValueError(f"bootstrap must be >= 0, got {bootstrap}")
        self.corpus = resolve_corpus(corpus)
        if seq_len is not None:
            self.corpus = dataclasses.replace(self.corpus, seq_len=seq_len)  # validated by CorpusConfig
        if self.corpus.val_fraction <= 0:
            raise ValueError("the corpus has no validation split (val_fraction is 0)")
        self.windows, self.bootstrap, self.seed = windows, bootstrap, seed
        self._rows: dict[str, list[Any]] = {}  # tokenizer fingerprint -> the first `windows` validation rows
        self._rows_lock, self._forward_lock = threading.Lock(), threading.Lock()

    def samples(self, limit: int | None = None) -> list[Sample]:
        count = self.windows if limit is None else min(limit, self.windows)
        return [Sample(f"val-{i:04d}", {"window": i}) for i in range(count)]

    def validation_rows(self, tokenizer: Any) -> list[dict[str, Any]]:
        """The first `windows` validation batches of one row each ({input_ids, labels, position_ids} [1, T]),
        as the trainer's validation loader yields them for `tokenizer` (tokenised once per tokenizer)."""
        from openk2.data.loader import PackedLoader

        with self._rows_lock:
            key = tokenizer.fingerprint
            if key not in self._rows:
                loader = PackedLoader(self.corpus, tokenizer, batch_size=1, split="val", loop=False)
                rows = []
                for batch in loader:
                    rows.append(batch)
                    if len(rows) == self.windows:
                        break
                self._rows[key] = rows
            return self._rows[key]

    def evaluate(self, model: ChatModel, sample: Sample, ctx: EvalContext) -> Verdict:
        network = getattr(getattr(model, "engine", None), "model", None)
        tokenizer = getattr(model, "tokenizer", None)
        if network is None or tokenizer is None:
            return Verdict(float("nan"), None, {"error": f"{NOT_LOCAL}; got {type(model).__name__}", "tokens": 0})
        max_len = network.config.max_position_embeddings
        if self.corpus.seq_len > max_len:
            return Verdict(float("nan"), None, {"tokens": 0, "error": f"windows of {self.corpus.seq_len} tokens "
                                                f"exceed the model's {max_len} positions; lower seq_len"})
        rows = self.validation_rows(tokenizer)
        index = int(sample.data["window"])
        if index >= len(rows):
            return Verdict(float("nan"), None, {"tokens": 0, "error": f"the validation split has only "
                                                f"{len(rows)} windows of {self.corpus.seq_len} tokens"})
        nll, tokens = self._score(network, rows[index])
        return Verdict(nll, None, {"tokens": tokens, "mean_nll": nll / tokens if tokens else float("nan")})

    def _score(self, network: Any, row: dict[str, Any]) -> tuple[float, int]:
        """Summed next-token NLL (nats) over the row's targets, and their count; the forward of the trainer's
        validation (input_ids and labels only), the loss summed instead of averaged."""
        import torch
        import torch.nn.functional as F

        device = next(network.parameters()).device
        targets = row["labels"][0, 1:].to(device)
        with self._forward_lock, torch.no_grad():
            logits = network(row["input_ids"].to(device)).logits[0, :-1]
            nll = F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")
        return float(nll), int((targets != -100).sum())

    def aggregate(self, verdicts: Sequence[Verdict]) -> Aggregate:
        """exp(total NLL / total tokens) over the scored windows, with a percentile bootstrap interval (windows
        resampled with replacement, `bootstrap` times, seeded); NaN when no window was scored."""
        scored = [(v.score, int(v.detail.get("tokens", 0))) for v in verdicts
                  if int(v.detail.get("tokens", 0)) > 0 and math.isfinite(v.score)]
        if not scored:
            return Aggregate(float("nan"), float("nan"), float("nan"), 0)
        value = _pooled_perplexity(scored)
        if self.bootstrap == 0 or len(scored) == 1:
            return Aggregate(value, value, value, len(scored))
        rng = random.Random(self.seed)
        draws = sorted(_pooled_perplexity(rng.choices(scored, k=len(scored))) for _ in range(self.bootstrap))
        low, high = draws[int(0.025 * (len(draws) - 1))], draws[int(math.ceil(0.975 * (len(draws) - 1)))]
        return Aggregate(value, min(low, value), max(high, value), len(scored))


def _pooled_perplexity(scored: Sequence[tuple[float, int]]) -> float:
    return math.exp(sum(nll for nll, _ in scored) / sum(tokens for _, tokens in scored))
