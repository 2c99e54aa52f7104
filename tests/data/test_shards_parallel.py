"""A dp=2 run streaming token shards (written by rank 0 on start) trains exactly as one process from RAM."""

from __future__ import annotations

import copy

import pytest

from openk2.data.corpus import CorpusConfig, tokenizer_training_texts
from openk2.data.shards import read_manifest, source_dir
from openk2.data.tokenizer import K2Tokenizer, train_tokenizer
from openk2.train.config import RunConfig
from openk2.train.metrics import read_metrics
from tests.train.conftest import MICRO_DATA, MICRO_MODEL
from tests.train.parallel.ranks import run_ranks

STEPS = 3


def _train(rank: int, raw: dict) -> None:
    import openk2.train.trainer
    from openk2.train.parallel.trainer import ParallelTrainer

    openk2.train.trainer.plot_run = lambda run_dir: []
    ParallelTrainer(RunConfig.from_dict(raw)).run()


def _raw(tmp_path, name: str, batch_size: int, data: dict) -> dict:
    return {"out_dir": str(tmp_path / name), "model": dict(MICRO_MODEL), "tokenizer": {"path": str(tmp_path / "tok")},
            "data": data, "optim": {"lr": 1e-2, "ns_dtype": "float32"},
            "schedule": {"warmup_steps": 1, "decay_fraction": 0.25},
            "train": {"steps": STEPS, "batch_size": batch_size, "log_every": 1, "eval_every": STEPS,
                      "eval_batches": 1, "checkpoint_every": STEPS, "threads": 1, "precision": "fp32"},
            "parallel": {"dp": 2} if batch_size == 2 else {}}


@pytest.mark.slow
def test_dp2_from_shards_matches_single_process_from_ram(tmp_path, monkeypatch):
    texts = tokenizer_training_texts(CorpusConfig.from_dict(copy.deepcopy(MICRO_DATA)), 200_000)
    train_tokenizer(texts, MICRO_MODEL["vocab_size"]).save(tmp_path / "tok")
    sharded = {**copy.deepcopy(MICRO_DATA), "shard_dir": str(tmp_path / "shards")}
    run_ranks(2, _train, _raw(tmp_path, "dp2", 2, sharded))
    cfg = CorpusConfig.from_dict(sharded)
    assert read_manifest(source_dir(cfg.shard_dir, cfg, cfg.sources[0], K2Tokenizer.load(tmp_path / "tok")))
    from openk2.train.trainer import Trainer

    monkeypatch.setattr("openk2.train.trainer.plot_run", lambda run_dir: [])
    Trainer(RunConfig.from_dict(_raw(tmp_path, "single", 4, copy.deepcopy(MICRO_DATA)))).run()
    got = {r["step"]: r for r in read_metrics(tmp_path / "dp2") if "loss" in r}
    want = {r["step"]: r for r in read_metrics(tmp_path / "single") if "loss" in r}
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
    assert got[STEPS]["val_loss"] == pytest.approx(want[STEPS]["val_loss"], rel=1e-5)
