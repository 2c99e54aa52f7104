"""Checkpoints under faults: pruning never loses the newest good checkpoint, every corrupt-manifest form falls
back with a warning naming the file, and a full disk stops the run with one line and the previous checkpoint
intact (a real 2 MiB tmpfs when mountable, else a patched write)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import tomli_w

from openk2.train.checkpoint import MANIFEST, CheckpointManager, CheckpointWriteError, verify_checkpoint


def _writer(payload: bytes):
    def write(path: Path) -> None:
        (path / "weights.bin").write_bytes(payload)
    return write


def _corrupt(path: Path) -> None:
    (path / "weights.bin").write_bytes(b"\0" * (path / "weights.bin").stat().st_size)  # same size: checksum


def test_pruning_counts_only_good_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(1, _writer(b"a" * 64))
    for step in (2, 3):  # newer checkpoints that go bad after writing
        _corrupt(mgr.save(step, _writer(b"b" * 64)))
    mgr.save(4, _writer(b"c" * 64))
    # keep_last=1 keeps the newest good one (4); the broken ones are older than it, so they go too.
    assert [p.name for p in mgr.checkpoints()] == ["step-0000004"]

    mgr = CheckpointManager(tmp_path / "b", keep_last=2)
    for step in (1, 2):
        mgr.save(step, _writer(bytes([step]) * 64))
    _corrupt(mgr.path_for(2))
    mgr.save(3, _writer(b"z" * 64))
    # Only 1 and 3 are good: both stay (the broken 2 does not count toward keep_last and lies between them).
    assert [p.name for p in mgr.checkpoints()] == ["step-0000001", "step-0000002", "step-0000003"]
    assert mgr.latest() == mgr.path_for(3)


def test_pruning_sorts_by_step_not_by_name(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(10_000_000, _writer(b"x"))  # 8 digits: sorts before step-0000009 by name
    mgr.save(9, _writer(b"y"))  # a resumed run writing an older step keeps the newest good one by step
    assert [p.name for p in mgr.checkpoints()] == ["step-10000000"]
    assert mgr.latest().name == "step-10000000"


def test_all_corrupt_then_fresh_checkpoints_survive(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    for step in (5, 6):
        _corrupt(mgr.save(step, _writer(b"q" * 64)))
    assert CheckpointManager(tmp_path).latest() is None  # a resume starts from scratch...
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(1, _writer(b"fresh"))  # ...and its first checkpoint is not pruned for being the oldest name
    assert mgr.path_for(1).is_dir() and CheckpointManager(tmp_path).latest() == mgr.path_for(1)


@pytest.mark.parametrize(("content", "expected"), [
    (b'{"step": 2, "files": {}}\xff', "not UTF-8"),
    (b"[1, 2, 3]", "JSON list, not an object"),
    (b'"files"', "JSON str, not an object"),
    (b'{"step": 2}', "no 'files' object"),
    (b'{"step": 2, "files": {"weights.bin": {"size": 1}}}', "malformed entry"),
    (b'{"step": 2, "files": {"../../etc/passwd": {"size": 1, "sha256": "0"}}}', "malformed entry"),
    (b'{"step": 2, "files": {"weights.bin": {"si', "not valid JSON"),
    (b"", "not valid JSON"),
    (b'{"step": 7, "files": {}}', "for step 7, not 2"),
])
def test_every_corrupt_manifest_falls_back_naming_the_file(tmp_path, capsys, content, expected):
    mgr = CheckpointManager(tmp_path, keep_last=5)
    mgr.save(1, _writer(b"good"))
    bad = mgr.save(2, _writer(b"newer"))
    (bad / MANIFEST).write_bytes(content)
    assert CheckpointManager(tmp_path).latest() == mgr.path_for(1)
    err = capsys.readouterr().err
    assert f"skipping checkpoint {bad}: {bad / MANIFEST}" in err and expected in err
    assert expected in verify_checkpoint(bad)


def test_full_disk_is_one_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(1, _writer(b"good"))

    def full(path: Path) -> None:
        (path / "weights.bin").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(path / "weights.bin"))

    with pytest.raises(CheckpointWriteError, match=r"no space left on device .* previous checkpoint .*step-0000001 "
                                                   r"is intact") as info:
        mgr.save(2, full)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # one line, no chained traceback
    assert [p.name for p in mgr.checkpoints()] == ["step-0000001"] and mgr.latest() == mgr.path_for(1)
    assert not list(tmp_path.glob(".tmp-*"))  # the half-written staging directory is gone


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (root can mount one); skipped where mounting is not allowed."""
    mount = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (the patched-write test covers the logic)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_full_tmpfs_stops_pretrain_with_one_line(micro_raw, small_tmpfs):
    """The real thing: `openk2 pretrain` into a 2 MiB tmpfs. The step-2 checkpoint (1.3 MB) fits, step 4 does
    not: exit code 1, one line on stderr, no traceback, step 2 still the newest good checkpoint."""
    micro_raw["model"].update(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                              vocab_size=768)
    micro_raw["train"].update(steps=6, checkpoint_every=2, keep_checkpoints=3, eval_every=100)
    config = small_tmpfs.parent / "run.toml"
    config.write_text(tomli_w.dumps(micro_raw))
    run_dir = small_tmpfs / "run"
    proc = subprocess.run([sys.executable, "-m", "openk2", "pretrain", "--config", str(config), "--out", str(run_dir)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "cannot write checkpoint" in line]
    assert len(lines) == 1 and "no space left on device" in lines[0] and "is intact" in lines[0], proc.stderr[-3000:]
    good = CheckpointManager(run_dir / "checkpoints").latest()
    assert good is not None and good.name in lines[0]
    assert json.loads((good / "trainer_state.json").read_text())["step"] == int(good.name.removeprefix("step-"))
