"""A torch.distributed process group of its own for weight sync, outside the default (world) group.

The trainer and the rollout workers must share a group for the checkpoint engine, but the default group is
what the training code means by "distributed" (QK-Clip all-reduces its max logits over it, ZeRO shards over
it): putting rollout workers into it would make them data-parallel ranks. So the weight-sync group is a
`ProcessGroupGloo` (or `ProcessGroupNCCL`) built directly on its own `TCPStore`, and `dist.is_initialized()`
stays False unless the caller initialised a world of its own. The bucket plan's metadata travels through the
store as JSON (names, shapes, dtype names: nothing a peer could make this process execute).
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist

_CANCELLED = "cancelled"


class StandaloneGroup:
    """A process group that needs no `init_process_group`: rank 0 hosts the store, ranks 1.. connect to it."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 600.0, store: dist.TCPStore | None = None) -> None:
        """Rank 0 may pass the `store` it opened with `open_store` (to learn its port before the others join)."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        timeout = timedelta(seconds=timeout_s)
        self.store = store or dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                                            wait_for_workers=False)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        prefixed = dist.PrefixStore("weight-sync", self.store)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        self._round = 0
        self._address = (host if rank else "127.0.0.1", self.store.port, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int):
        """Start broadcasting `tensor` from rank `src` to every rank; returns the work to `.wait()` on."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self.pg.broadcast([tensor], opts)

    def all_gather_metas(self, mine: list[tuple[str, tuple[int, ...], torch.dtype]]) -> list[list]:
        """Every rank's (name, shape, dtype) list, indexed by rank (collective)."""
        key = f"metas/{self._round}/"
        self.store.set(key + str(self.rank), json.dumps([(n, list(s), str(d)) for n, s, d in mine]))
        raw = [json.loads(self.store.get(key + str(r))) for r in range(self.world_size)]
        if any(items == _CANCELLED for items in raw):
            raise RuntimeError("weight-sync group cancelled (a peer was lost)")
        out = [[(n, tuple(s), _dtype(d)) for n, s, d in items] for items in raw]
        if self._round >= 2:  # every rank has read round - 2 (each wrote round - 1 only after reading it)
            self.store.delete_key(f"metas/{self._round - 2}/{self.rank}")
        self._round += 1
        return out

    def cancel(self) -> None:
        """Make a metadata exchange that waits on a lost peer raise now instead of at the timeout: write the
        missing ranks' entries of the current round as "cancelled" (through a connection of its own, since the
        waiting thread holds this rank's)."""
        host, port, timeout = self._address
        client = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        key = f"metas/{self._round}/"
        for r in range(self.world_size):
            if not client.check([key + str(r)]):
                client.set(key + str(r), json.dumps(_CANCELLED))


def open_store(host: str, world_size: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """Rank 0's store on a free port of `host` (its `.port` is what the other ranks connect to)."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight-sync metadata names an unknown dtype {name!r}")
    return dtype


__all__ = ["StandaloneGroup", "open_store"]
