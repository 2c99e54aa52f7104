"""Small helpers shared by the benchmark scripts: wall-clock timing with medians, a matmul ceiling, machine info."""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

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
