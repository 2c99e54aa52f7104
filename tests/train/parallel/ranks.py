"""Run a function on N real gloo processes (torch.multiprocessing spawn, env:// rendezvous like torchrun)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out[rank] = fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """fn(rank, *args) on `world` processes (fn must be importable by name); returns {rank: result}."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_entry, args=(world, _free_port(), fn, args, out), nprocs=world, join=True)
        return dict(out)
