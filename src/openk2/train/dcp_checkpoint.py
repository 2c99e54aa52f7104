"""One checkpoint written by every rank at once: DCP shards in parallel, per-rank files, an atomic commit.

Save (collective over `group`, or one process): rank 0 stages `root/.tmp-step-N/`; every rank writes its DCP
shards into `dcp/` (synchronously, or copied to CPU and written by a background thread: `async_save`), and its
`ranks/rank-NNNNN.pt` (RNG states); rank 0 writes the run state (and the HF export, where the trainer asks for
it). Each rank checksums its own files; rank 0 checksums the rest, writes the manifest and renames the
directory into place. An asynchronous save commits when the next save begins or `finish()` is called, so a
crash mid-write leaves only a staging directory and the previous checkpoint stays the newest good one.

Any rank's I/O error (a full disk) becomes one CheckpointWriteError on every rank, the staging directory is
removed, and nothing committed is touched.
"""

from __future__ import annotations

import errno
import io
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from openk2.train.checkpoint import CheckpointManager, CheckpointWriteError, _DiskErrors, as_disk_error, file_entries
from openk2.train.dcp import DCP_DIR, async_save_state, save_state

RANK_DIR = "ranks"  # one rank-NNNNN.pt per rank: what differs per rank and is not a tensor (RNG states)


def rank_file(path: Path, rank: int) -> Path:
    return path / RANK_DIR / f"rank-{rank:05d}.pt"


def _as_oserror(err: BaseException | None) -> OSError | None:
    """`err` as a plain OSError that pickles across ranks: the disk error behind it (DCP wraps each rank's
    failure into a CheckpointException), or EIO with its type and message."""
    if err is None:
        return None
    if isinstance(err, CheckpointException):
        inner = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
        inner = [e for e in inner if isinstance(e, BaseException)]
        err = next((e for e in inner if as_disk_error(e) is not None), inner[0] if inner else err)
    found = as_disk_error(err)
    if found is None:
        first_line = (str(err).strip().splitlines() or [""])[0]
        return OSError(errno.EIO, f"{type(err).__name__}: {first_line}")
    return OSError(found.errno, found.strerror, found.filename)


def _nearly_full(path: Path) -> bool:
    """Whether the file system of `path` has under 1 MiB left: torch.save reports a short write on a full
    disk as a RuntimeError ("unexpected pos"), so the free space is what tells."""
    try:
        return shutil.disk_usage(path).free < (1 << 20)
    except OSError:
        return False


@dataclass
class _Pending:
    step: int
    staging: Path
    future: Future | None


class ShardedCheckpointer:
    """Saves checkpoints through `manager` from `world` ranks (this one is `rank` in `group`)."""

    def __init__(self, manager: CheckpointManager, group: dist.ProcessGroup | None = None,
                 async_save: bool = False) -> None:
        self.manager, self.group, self.async_save = manager, group, async_save
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        self.world = dist.get_world_size(group) if distributed else 1
        self.pending: _Pending | None = None

    # ------------------------------------------------------------------------------------------ collectives
    def _all_ok(self, ok: bool) -> bool:
        if self.world == 1:
            return ok
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag)

    def _gather(self, value: Any) -> list[Any]:
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _fail(self, step: int, staging: Path, errors: list[BaseException | None]) -> None:
        """Raise one CheckpointWriteError (on every rank) for the first rank's error; removes the staging dir."""
        os_err = next(e for e in errors if e is not None)
        if os_err.errno != errno.ENOSPC and _nearly_full(self.manager.root):
            os_err = OSError(errno.ENOSPC, "No space left on device")
        try:
            with _DiskErrors(self.manager, step, staging):
                raise os_err
        except CheckpointWriteError as clear:
            self.pending = None
            raise clear from None

    # ------------------------------------------------------------------------------------------ save
    def save(self, step: int, state: dict[str, Any], rank_state: dict[str, Any],
             write_main: Callable[[Path], None]) -> Path:
        """Write checkpoint `step`: `state` as DCP shards (every rank), `rank_state` per rank, and whatever
        `write_main(dir)` adds on rank 0. Returns its final path (committed unless saving asynchronously)."""
        self.finish()
        staging = self.manager.root / f".tmp-{self.manager.path_for(step).name}"
        error: BaseException | None = None
        if self.rank == 0:
            try:
                staging = self.manager.stage(step)
            except CheckpointWriteError as err:
                error = err
        if not self._all_ok(error is None):
            if error is not None:
                raise error
            raise CheckpointWriteError(f"cannot write checkpoint {self.manager.path_for(step)}: rank 0 could "
                                       "not create its directory")
        try:
            target = rank_file(staging, self.rank)
            target.parent.mkdir(parents=True, exist_ok=True)
            buffer = io.BytesIO()  # torch.save reports a failed write as a RuntimeError; Python's write as OSError
            torch.save(rank_state, buffer)
            target.write_bytes(buffer.getbuffer())
            if self.rank == 0:
                write_main(staging)
        except Exception as err:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
            error = err
        errors = self._gather(_as_oserror(error))
        if any(e is not None for e in errors):
            self._fail(step, staging, errors)
        future = None
        try:
            if self.async_save:
                future = async_save_state(state, staging / DCP_DIR, self.group)
            else:
                save_state(state, staging / DCP_DIR, self.group)
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP already told every rank
            self._fail(step, staging, [_as_oserror(err)])
        self.pending = _Pending(step, staging, future)
        if not self.async_save:
            self.finish()
        return self.manager.path_for(step)

    def finish(self) -> Path | None:
        """Wait for the pending write (if any), checksum and commit it; the committed path, or None."""
        if self.pending is None:
            return None
        step, staging, future = self.pending.step, self.pending.staging, self.pending.future
        error: BaseException | None = None
        entries: dict[str, dict] = {}
        try:
            if future is not None:
                future.result()
            mine = [rank_file(staging, self.rank), *sorted((staging / DCP_DIR).glob(f"__{self.rank}_*"))]
            entries = file_entries(staging, [f for f in mine if f.is_file()])
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - gathered below, raised on every rank
            error = err
        gathered = self._gather((_as_oserror(error), entries))
        if any(e is not None for e, _ in gathered):
            self._fail(step, staging, [e for e, _ in gathered])
        final = self.manager.path_for(step)
        if self.rank == 0:
            try:
                known = {k: v for _, part in gathered for k, v in part.items()}
                final = self.manager.commit(step, staging, known)
            except CheckpointWriteError as err:
                error = err
        self.pending = None
        if not self._all_ok(error is None):
            raise error if error is not None else CheckpointWriteError(
                f"cannot write checkpoint {final}: rank 0 could not commit it")
        return final
