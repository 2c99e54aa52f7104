"""Small helpers shared by the benchmark scripts: wall-clock timing with medians, alternating CPU-time A/B rounds,
HF copies, machine info, gloo ranks."""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def time_call(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes (CPU: ops are synchronous; CUDA: synchronised before and after)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median seconds per call of fn over `repeats` timed calls after `warmup` untimed ones, and all the times."""
    for _ in range(warmup):
        fn()
    times = [time_call(fn) for _ in range(repeats)]
    return statistics.median(times), times


def alternating_cpu_times(names: list[str], prepare: Callable[[str, int], Callable[[], object]], rounds: int,
                          warmup: int = 1) -> dict[str, list[float]]:
    """{name: process CPU seconds of its call in each of `rounds` rounds}, after `warmup` untimed rounds.

    In round i every variant runs once, in the order of `names` on even rounds and reversed on odd ones, so slow
    drift (load, caches, the allocator) hits all alike. `prepare(name, i)` does that call's untimed setup (fresh
    inputs, zeroed grads) and returns the call to time. CPU time rather than wall time: with one thread it is
    robust to other processes' load."""
    order = list(names)
    times: dict[str, list[float]] = {name: [] for name in order}
    for i in range(warmup + rounds):
        for name in order if i % 2 == 0 else order[::-1]:
            call = prepare(name, i)
            start = time.process_time()
            call()
            spent = time.process_time() - start
            if i >= warmup:
                times[name].append(spent)
    return times


def quiet_transformers():
    """Import transformers with its logging and progress bars turned down; returns the module."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def hf_copy(model: torch.nn.Module, **from_pretrained_kwargs):
    """transformers' DeepseekV3ForCausalLM holding `model`'s weights (fp32), via a temporary HF checkpoint."""
    transformers = quiet_transformers()
    with tempfile.TemporaryDirectory() as checkpoint:
        model.save_pretrained(checkpoint)
        return transformers.DeepseekV3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                                  **from_pretrained_kwargs)


def machine_summary() -> str:
    """One line: CPU model, cores, torch threads, relevant ISA flags, GPU if any, load average."""
    cpu, flags = "", set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name") and not cpu:
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags] or ["?"]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    load = "/".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads, "
            f"ISA {'+'.join(isa)}, {gpu}, load avg {load}")


def _rank_entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = fn(rank, world, *args)
    finally:
        if world > 1:
            dist.destroy_process_group()


def run_on_ranks(world: int, fn: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """{rank: fn(rank, world, *args)} on `world` spawned gloo processes of one thread each (env:// rendezvous on
    a free local port, as torchrun sets it up); fn must be importable by name (module level)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_entry, args=(world, port, fn, args, results), nprocs=world)
        return dict(results)
