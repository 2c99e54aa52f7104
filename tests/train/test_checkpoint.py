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
