"""Atomic, verifiable training checkpoints: written into a staging directory, checksummed, then renamed.

A checkpoint directory `step-000123/` holds whatever the trainer writes (the model and optimizer as
torch.distributed.checkpoint shards under `dcp/`, HF-layout safetensors for single-process runs, loader
position, RNG states) and `manifest.json` with the SHA-256 and size of every file, written last. A directory
without a valid manifest is incomplete or corrupted and is never resumed from, never counted when old
checkpoints are pruned, and never the reason a good one is deleted.

Single process: `save(step, write)`. Several ranks writing one checkpoint: rank 0 calls `stage(step)`, every
rank writes into that directory (and may checksum its own files, `file_entries`), then rank 0 calls
`commit(step, staging, known_entries)`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

MANIFEST = "manifest.json"
_PREFIX = "step-"
_STAGING = ".tmp-"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (full disk, I/O error); the previous checkpoints are untouched."""


_FULL_DISK_MARKERS = ("No space left on device", "StorageFull", "os error 28")


def as_disk_error(err: BaseException) -> OSError | None:
    """`err` as an OSError when it is one, or when a library (safetensors, torch.save) reported a full disk in
    its own exception type; None for anything else."""
    if isinstance(err, OSError):
        return err
    if any(marker in str(err) for marker in _FULL_DISK_MARKERS):
        return OSError(errno.ENOSPC, "No space left on device")
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_entries(root: Path, files: list[Path]) -> dict[str, dict]:
    """Manifest entries (size, SHA-256) for `files` under `root`, keyed by their path relative to `root`."""
    return {str(f.relative_to(root)): {"size": f.stat().st_size, "sha256": _sha256(f)} for f in files}


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with file.open("rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_of(path: Path) -> int | None:
    """The step number of a `step-N` directory name, None for any other name."""
    digits = path.name.removeprefix(_PREFIX)
    return int(digits) if path.name.startswith(_PREFIX) and digits.isdigit() else None


def read_manifest(path: Path) -> tuple[dict[str, dict] | None, str | None]:
    """(files, None) from `path/manifest.json`, or (None, reason) naming the file when it is unusable."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None, f"no manifest ({manifest}): the write did not finish"
    try:
        data = json.loads(manifest.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        return None, f"{manifest} is not UTF-8 text ({err.reason} at byte {err.start})"
    except json.JSONDecodeError as err:
        return None, f"{manifest} is not valid JSON (truncated or corrupt: {err.msg} at char {err.pos})"
    except OSError as err:
        return None, f"{manifest} cannot be read ({err.strerror})"
    if not isinstance(data, dict):
        return None, f"{manifest} holds a JSON {type(data).__name__}, not an object"
    files = data.get("files")
    if not isinstance(files, dict):
        return None, f"{manifest} has no 'files' object"
    for name, meta in files.items():
        inside = not Path(name).is_absolute() and ".." not in Path(name).parts
        if not inside or not isinstance(meta, dict) or not isinstance(meta.get("size"), int) \
                or not isinstance(meta.get("sha256"), str):
            return None, f"{manifest} has a malformed entry {name!r}"
    if data.get("step") != step_of(path) and step_of(path) is not None:
        return None, f"{manifest} is for step {data.get('step')!r}, not {step_of(path)}"
    return files, None


def verify_checkpoint(path: Path) -> str | None:
    """None when every file listed in the manifest is present with its size and checksum, else the reason."""
    files, problem = read_manifest(path)
    if problem is not None:
        return problem
    for name, meta in files.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != meta["size"]:
            return f"{file} has {file.stat().st_size} bytes, the manifest says {meta['size']}"
        if _sha256(file) != meta["sha256"]:
            return f"{file} fails its checksum"
    return None


class CheckpointManager:
    """Writes `root/step-N` atomically, keeps the newest `keep_last` good ones, finds the newest good one."""

    def __init__(self, root: str | Path, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:07d}"

    # ------------------------------------------------------------------------------------------ writing
    def save(self, step: int, write: Callable[[Path], None]) -> Path:
        """Call `write(staging_dir)` to fill a checkpoint, add the manifest, rename into place, prune old ones."""
        staging = self.stage(step)
        with self._disk_errors(step, staging):
            write(staging)
        return self.commit(step, staging)

    def stage(self, step: int) -> Path:
        """A fresh, empty staging directory for step `step` (the same name on every rank)."""
        staging = self.root / f"{_STAGING}{self.path_for(step).name}"
        with self._disk_errors(step, staging):
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
        return staging

    def commit(self, step: int, staging: Path, known: dict[str, dict] | None = None) -> Path:
        """Checksum what `known` does not cover, write the manifest, rename `staging` into place, prune."""
        final = self.path_for(step)
        with self._disk_errors(step, staging):
            known = dict(known or {})
            rest = [f for f in sorted(staging.rglob("*")) if f.is_file() and str(f.relative_to(staging)) not in known]
            files = dict(sorted({**known, **file_entries(staging, rest)}.items()))
            (staging / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
            _fsync_tree(staging)
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
        self._prune(trusted=final)
        return final

    def _disk_errors(self, step: int, staging: Path):
        return _DiskErrors(self, step, staging)

    # ------------------------------------------------------------------------------------------ reading
    def checkpoints(self) -> list[Path]:
        """Checkpoint directories, oldest step first (complete or not)."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and step_of(p) is not None]
        return sorted(found, key=step_of)

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies; broken ones are reported on stderr and skipped."""
        for path in reversed(self.checkpoints()):
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            print(f"warning: skipping checkpoint {path}: {problem}", file=sys.stderr)
        return None

    def _prune(self, trusted: Path) -> None:
        """Keep the newest `keep_last` checkpoints that verify (by step; `trusted` was checksummed as it was
        committed), delete everything older than them; broken ones never count, so they never push out a good
        one, and with fewer than `keep_last` good ones nothing is deleted."""
        kept: list[Path] = []
        for path in reversed(self.checkpoints()):  # full checksums: at most keep_last - 1 directories read
            if len(kept) == self.keep_last:
                break
            if path == trusted or verify_checkpoint(path) is None:
                kept.append(path)
        if len(kept) == self.keep_last:
            for path in self.checkpoints():
                if step_of(path) < step_of(kept[-1]):
                    shutil.rmtree(path, ignore_errors=True)
        for stale in self.root.glob(f"{_STAGING}*"):  # staging dirs of runs that died mid-write
            shutil.rmtree(stale, ignore_errors=True)


class _DiskErrors:
    """Turns an OSError while writing into one CheckpointWriteError line; removes the half-written staging dir."""

    def __init__(self, manager: CheckpointManager, step: int, staging: Path) -> None:
        self.manager, self.step, self.staging = manager, step, staging

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, tb) -> bool:
        err = None if err is None else as_disk_error(err)
        if err is None:
            return False
        shutil.rmtree(self.staging, ignore_errors=True)
        previous = [p for p in self.manager.checkpoints() if step_of(p) != self.step]
        good = next((p for p in reversed(previous) if verify_checkpoint(p) is None), None)
        kept = f"; the previous checkpoint {good} is intact" if good is not None else ""
        if err.errno == errno.ENOSPC:
            free = shutil.disk_usage(self.manager.root).free if self.manager.root.exists() else 0
            reason = (f"no space left on device ({free / 2**20:.1f} MiB free under {self.manager.root} once the "
                      "partial write was removed)")
        else:
            reason = f"{err.strerror or err} ({err.filename or self.staging})"
        target = self.manager.path_for(self.step)
        raise CheckpointWriteError(f"cannot write checkpoint {target}: {reason}{kept}") from None
