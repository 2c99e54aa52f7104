"""Perplexity of a real tiny checkpoint through `LocalChatModel`: finite, near the vocabulary size for random
weights, and equal to exp of the model's own loss on the trainer's validation rows."""

from __future__ import annotations

import math

import pytest
import torch

from openk2.data.corpus import CorpusConfig
from openk2.data.loader import PackedLoader
from openk2.eval.base import EvalContext, ScriptedChatModel, Verdict
from openk2.eval.perplexity import NOT_LOCAL, PerplexityBenchmark, resolve_corpus
from openk2.eval.registry import get
from openk2.llm.local import LocalChatModel
from tests.infer import test_server as _srv

checkpoint = _srv.checkpoint  # a random tiny K2 (vocab 768) with a trained tokenizer, shared with the server tests

MICRO_CORPUS = {"seq_len": 64, "val_fraction": 0.05, "sources": [{"kind": "math", "weight": 1.0, "num_docs": 300}]}
WINDOWS = 8


@pytest.fixture(scope="module")
def local(checkpoint):
    return LocalChatModel(checkpoint, max_seq_len=256, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def bench():
    return PerplexityBenchmark(corpus=MICRO_CORPUS, windows=WINDOWS)


@pytest.fixture(scope="module")
def verdicts(bench, local):
    return [bench.evaluate(local, s, EvalContext()) for s in bench.samples()]


def test_registered_with_lower_is_better():
    bench = get("perplexity")
    assert (bench.metric, bench.higher_is_better, bench.binary) == ("perplexity", False, False)
    assert bench.corpus == CorpusConfig() and len(bench.samples()) == 64 and bench.samples(3)[-1].id == "val-0002"


def test_random_model_perplexity_is_of_vocabulary_order(bench, local, verdicts):
    vocab = local.engine.model.config.vocab_size
    agg = bench.aggregate(verdicts)
    assert agg.n == WINDOWS and math.isfinite(agg.value)
    assert vocab / 2 < agg.value < 2 * vocab  # near-uniform predictions from small random weights
    assert agg.low <= agg.value <= agg.high and agg.low < agg.high
    assert bench.aggregate(verdicts) == agg  # the bootstrap is seeded
    assert all(v.detail["tokens"] > 0 and v.score > 0 for v in verdicts)


def test_equals_exp_of_the_models_own_loss_on_the_validation_rows(bench, local, verdicts):
    corpus = CorpusConfig.from_dict(MICRO_CORPUS)
    model = local.engine.model
    total, count = 0.0, 0
    with torch.no_grad():
        for i, batch in enumerate(PackedLoader(corpus, local.tokenizer, batch_size=1, split="val", loop=False)):
            if i == WINDOWS:
                break
            out = model(batch["input_ids"], labels=batch["labels"])
            n = int((batch["labels"][:, 1:] != -100).sum())
            total, count = total + out.loss.item() * n, count + n
    assert sum(v.detail["tokens"] for v in verdicts) == count
    assert bench.aggregate(verdicts).value == pytest.approx(math.exp(total / count), rel=1e-5)


def test_non_local_model_and_missing_windows_give_nan_with_a_reason(bench, local):
    sample = bench.samples(1)[0]
    v = bench.evaluate(ScriptedChatModel(["hi"]), sample, EvalContext())
    assert math.isnan(v.score) and NOT_LOCAL in v.detail["error"]
    assert math.isnan(bench.aggregate([v]).value)
    far = PerplexityBenchmark(corpus=MICRO_CORPUS, windows=10_000)
    beyond = far.evaluate(local, far.samples()[-1], EvalContext())
    assert math.isnan(beyond.score) and "only" in beyond.detail["error"]
    too_long = PerplexityBenchmark(corpus=MICRO_CORPUS, seq_len=4096, windows=1)
    assert "positions" in too_long.evaluate(local, too_long.samples()[0], EvalContext()).detail["error"]


def test_aggregate_pools_tokens_not_windows():
    bench = PerplexityBenchmark(bootstrap=0)
    verdicts = [Verdict(10.0, None, {"tokens": 10}), Verdict(30.0, None, {"tokens": 10}),
                Verdict(float("nan"), None, {"tokens": 0, "error": "x"})]
    agg = bench.aggregate(verdicts)
    assert agg.n == 2 and agg.value == pytest.approx(math.exp(40 / 20))


def test_corpus_from_a_run_config(tmp_path):
    (tmp_path / "run_config.json").write_text('{"data": {"seq_len": 128, "sources": [{"kind": "math"}]}}')
    assert resolve_corpus(tmp_path / "run_config.json").seq_len == 128
    (tmp_path / "run.toml").write_text('[data]\nseq_len = 96\n[[data.sources]]\nkind = "math"\n')
    assert PerplexityBenchmark(corpus=str(tmp_path / "run.toml")).corpus.seq_len == 96
    with pytest.raises(ValueError, match="does not exist"):
        PerplexityBenchmark(corpus=tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="windows"):
        PerplexityBenchmark(windows=0)
