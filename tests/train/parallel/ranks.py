"""Run a function on N real gloo processes (env:// rendezvous like torchrun), started from a forkserver.

Each rank is a new process with its own gloo process group, as with `mp.spawn`; what differs is how it starts.
A spawned rank imports torch and openk2 afresh (~2 s of CPU per rank, most of a micro test's cost, and the
suite starts ~70 ranks). Here one forkserver process, started on the first call, imports them once, and every
rank forks from it: it starts in ~0.1 s with nothing of the test process (no fixtures, no patched modules; the
forkserver has only imported `_PRELOAD`). The rank takes the caller's current environment, working directory
and stdout/stderr, which `mp.spawn` would have given it (the forkserver's own are those of its start).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the forkserver (a module that fails to import is skipped there, as multiprocessing does).
_PRELOAD = ["torch", "torch.distributed", "openk2.train.parallel.trainer"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_to_callers_output(caller: int) -> None:
    """Point this process's stdout and stderr at the caller's current ones (pytest's capture of the running
    test), which the forkserver, started during some earlier test, does not hold."""
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{caller}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:  # no /proc, or an output that cannot be reopened (a socket): keep the forkserver's
            continue
        os.dup2(target, fd)
        os.close(target)


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out: dict, env: dict[str, str] | None = None,
           cwd: str | None = None, caller: int | None = None) -> None:
    if caller is not None:
        _write_to_callers_output(caller)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
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
    multiprocessing.set_forkserver_preload(_PRELOAD)  # takes effect when the forkserver starts (first call)
    with mp.Manager() as manager:
        out = manager.dict()
        caller = (dict(os.environ), os.getcwd(), os.getpid())
        mp.start_processes(_entry, args=(world, _free_port(), fn, args, out, *caller), nprocs=world, join=True,
                           start_method="forkserver")
        return dict(out)
