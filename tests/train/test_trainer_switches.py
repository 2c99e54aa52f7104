"""The trainer's speed/memory switches: train.loss_chunk_tokens (same losses) and train.compile (wired in)."""

from __future__ import annotations

import pytest

import openk2.train.trainer as trainer_module
from openk2.train.config import RunConfig
from openk2.train.metrics import read_metrics
from openk2.train.trainer import Trainer


def _losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


def test_chunked_loss_trains_like_the_plain_loss(micro_raw, tmp_path):
    """Three steps with the loss in 7-token chunks give the plain run's losses to fp32 rounding."""
    micro_raw["train"].update(steps=3, eval_every=3, checkpoint_every=3)
    Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "plain").run()
    micro_raw["train"]["loss_chunk_tokens"] = 7
    chunked = Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "chunked")
    assert chunked.model.loss_chunk_tokens == 7
    chunked.run()
    plain_losses, chunked_losses = _losses(tmp_path / "plain"), _losses(tmp_path / "chunked")
    assert len(plain_losses) == len(chunked_losses) == 3
    assert chunked_losses == pytest.approx(plain_losses, rel=1e-4)


def test_compile_switch_compiles_the_trainers_model(micro_raw, tmp_path, monkeypatch):
    """train.compile = true hands the model to compile_blocks once; a negative chunk size is a ValueError."""
    seen = []
    monkeypatch.setattr(trainer_module, "compile_blocks", lambda model: seen.append(model) or 0)
    micro_raw["train"]["compile"] = True
    trainer = Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "r")
    assert seen == [trainer.model]
    micro_raw["train"]["loss_chunk_tokens"] = -1
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        RunConfig.from_dict(micro_raw)
