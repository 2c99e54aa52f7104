"""Atomic, verifiable training checkpoints: written into a temporary directory, checksummed, then renamed.

A checkpoint directory `step-000123/` holds the model in HF layout (so transformers loads it as is) plus
whatever the trainer adds (optimizer state, loader position, RNG states), and `manifest.json` with the
SHA-256 and size of every file, written last. A directory without a valid manifest is incomplete or
corrupted and is never resumed from.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

MANIFEST = "manifest.json"
_PREFIX = "step-"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with file.open("rb") as f:
                os.fsync(f.fileno())


def verify_checkpoint(path: Path) -> str | None:
    """None when every file listed in the manifest is present with its size and checksum, else the reason."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (the write did not finish)"
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as err:
        return f"unreadable manifest ({err})"
    for name, meta in entries.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != meta["size"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {meta['size']}"
        if _sha256(file) != meta["sha256"]:
            return f"{name} fails its checksum"
    return None


class CheckpointManager:
    """Writes `root/step-N` atomically, keeps the last `keep_last`, finds the newest complete one."""

    def __init__(self, root: str | Path, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:07d}"

    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Call `write(tmp_dir)` to fill a checkpoint, add the manifest, rename into place, prune old ones."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path_for(step)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write(tmp)
        files = {
            str(f.relative_to(tmp)): {"size": f.stat().st_size, "sha256": _sha256(f)}
            for f in sorted(tmp.rglob("*")) if f.is_file()
        }
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()
        return final

    def checkpoints(self) -> list[Path]:
        """Checkpoint directories, oldest first (complete or not)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies; broken ones are reported on stderr and skipped."""
        for path in reversed(self.checkpoints()):
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            print(f"warning: skipping checkpoint {path}: {problem}", file=sys.stderr)
        return None

    def _prune(self) -> None:
        for path in self.checkpoints()[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
        for stale in self.root.glob(".tmp-*"):
            if not stale.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(stale, ignore_errors=True)
