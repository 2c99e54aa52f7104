"""Atomic checkpoints: manifest checksums, keep-last-N, corrupted ones skipped."""

import json

import pytest

from openk2.train.checkpoint import CheckpointManager, verify_checkpoint


def _writer(payload: bytes):
    def write(path):
        (path / "weights.bin").write_bytes(payload)
        (path / "sub").mkdir()
        (path / "sub" / "state.json").write_text(json.dumps({"n": len(payload)}))
    return write


def test_save_verify_and_keep_last(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        path = mgr.save(step, _writer(bytes([step]) * 100))
        assert verify_checkpoint(path) is None
    assert [p.name for p in mgr.checkpoints()] == ["step-0000020", "step-0000030"]
    assert mgr.latest() == mgr.path_for(30)
    assert not list(tmp_path.glob(".tmp-*"))


def test_truncated_or_partial_checkpoint_is_skipped(tmp_path, capsys):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, _writer(b"a" * 1000))
    latest = mgr.save(2, _writer(b"b" * 1000))
    with (latest / "weights.bin").open("r+b") as f:
        f.truncate(10)
    assert mgr.latest() == mgr.path_for(1)
    assert "weights.bin has 10 bytes" in capsys.readouterr().err

    (latest / "weights.bin").write_bytes(b"c" * 1000)  # same size, different content
    assert "checksum" in verify_checkpoint(latest)

    partial = mgr.path_for(3)
    partial.mkdir()
    (partial / "weights.bin").write_bytes(b"x")  # a crash before the manifest was written
    assert mgr.latest() == mgr.path_for(1)
    assert "no manifest" in capsys.readouterr().err


def test_bad_keep_last():
    with pytest.raises(ValueError):
        CheckpointManager("x", keep_last=0)


def test_trainer_checkpoint_restores_its_rng_state(micro_raw, tmp_path):
    """The RNG states a Trainer checkpoint saves (openk2.rng, every generator) are the ones a resume restores."""
    import numpy as np
    import torch

    from openk2.rng import capture_rng_state
    from openk2.train.config import RunConfig
    from openk2.train.dcp_checkpoint import rank_file
    from openk2.train.trainer import Trainer

    cfg = RunConfig.from_dict(micro_raw)
    summary = Trainer(cfg, out_dir=tmp_path / "r").run(max_steps=2)
    saved = torch.load(rank_file(summary.checkpoint, 0), weights_only=False)["rng"]
    assert {"python", "numpy", "torch"} <= set(saved) and ("cuda" in saved) == torch.cuda.is_available()
    resumed = Trainer(cfg, out_dir=tmp_path / "r", resume=True)
    torch.rand(5)  # the generators move on after loading; loading the checkpoint again puts them back
    resumed._load_checkpoint(summary.checkpoint)
    now = capture_rng_state()
    assert now["python"] == saved["python"] and torch.equal(now["torch"], saved["torch"])
    assert all(np.array_equal(a, b) for a, b in zip(now["numpy"], saved["numpy"], strict=True))


def test_async_checkpoints_commit_and_resume_exactly(micro_raw, tmp_path):
    """train.async_checkpoint: shards written by a background thread, committed at the next save or the run's
    end; the resumed run's losses equal the synchronous run's, bit for bit."""
    from openk2.train.config import RunConfig
    from openk2.train.metrics import read_metrics
    from openk2.train.trainer import Trainer

    Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "sync").run(max_steps=6)
    micro_raw["train"]["async_checkpoint"] = True
    cfg = RunConfig.from_dict(micro_raw)
    summary = Trainer(cfg, out_dir=tmp_path / "async").run(max_steps=4)
    mgr = CheckpointManager(tmp_path / "async" / "checkpoints")
    assert [p.name for p in mgr.checkpoints()] == ["step-0000002", "step-0000004"]
    assert all(verify_checkpoint(p) is None for p in mgr.checkpoints()) and summary.checkpoint == mgr.latest()
    assert not list((tmp_path / "async" / "checkpoints").glob(".tmp-*"))
    Trainer(cfg, out_dir=tmp_path / "async", resume=True).run(max_steps=6)
    losses = [{r["step"]: r["loss"] for r in read_metrics(tmp_path / run) if "loss" in r} for run in ("sync", "async")]
    assert losses[0] == losses[1] and sorted(losses[0]) == list(range(1, 7))
