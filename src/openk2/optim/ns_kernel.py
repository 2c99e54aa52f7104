"""Pick the Newton-Schulz kernel by a short measurement on the machine at hand, once per process.

Which kernel is fastest is a property of the hardware, not of the device type: on AVX2-only CPUs bf16
GEMM runs 5-50x slower than fp32 (emulating wins), on avx512_bf16 / AMX CPUs and GPUs the native bf16
kernels win (measured in docs/benchmarks.md). So instead of assuming, `select_ns_kernel` times every
kernel on a small probe batch the first time a (device, dtype) pair is seen and caches the winner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from openk2.optim.newton_schulz import NS_KERNELS, newton_schulz

__all__ = ["clear_ns_kernel_cache", "fastest_kernel", "measure_ns_kernels", "pin_ns_kernel", "select_ns_kernel"]

# Preference on equal times: the native kernel is what torch.optim.Muon and GPUs compute.
_PREFERENCE = ("native", "emulated", "fp32")
# A probe like a K2 tiny-preset expert stack (moe_intermediate 128 x hidden 256): ~0.8 GFLOP per kernel
# call, 20-50 ms on one CPU core, so the whole measurement stays well under a second.
PROBE_SHAPE = (8, 128, 256)
PROBE_ROUNDS = 3

_CACHE: dict[tuple[str, int | None, torch.dtype], str] = {}
Measure = Callable[[torch.device, torch.dtype], Mapping[str, float]]


def fastest_kernel(timings: Mapping[str, float]) -> str:
    """The kernel with the smallest time; ties go to native, then emulated, then fp32."""
    known = [k for k in _PREFERENCE if k in timings]
    if not known:
        raise ValueError(f"no timings for any Newton-Schulz kernel, got {sorted(timings)}")
    return min(known, key=lambda k: (timings[k], _PREFERENCE.index(k)))


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall time covers the kernel."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_ns_kernels(
    device: torch.device,
    dtype: torch.dtype,
    *,
    shape: tuple[int, int, int] = PROBE_SHAPE,
    rounds: int = PROBE_ROUNDS,
    steps: int = 5,
) -> dict[str, float]:
    """Seconds per call of each kernel on a random probe batch: best of `rounds` interleaved runs."""
    X = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
    for kernel in NS_KERNELS:  # warm-up: library initialisation and first-touch page faults
        newton_schulz(X, steps, dtype, kernel)
    best = dict.fromkeys(NS_KERNELS, float("inf"))
    # Interleaved rounds and the minimum: load from other processes only ever adds time.
    for _ in range(rounds):
        for kernel in NS_KERNELS:
            _sync(device)
            start = time.perf_counter()
            newton_schulz(X, steps, dtype, kernel)
            _sync(device)
            best[kernel] = min(best[kernel], time.perf_counter() - start)
    return best


def select_ns_kernel(device: torch.device, dtype: torch.dtype, *, measure: Measure | None = None) -> str:
    """The Newton-Schulz kernel for `dtype` on `device`: measured on first use, then cached per process."""
    if dtype in (torch.float32, torch.float64):
        return "native"  # all three kernels are the same fp32 arithmetic then: nothing to choose
    key = (device.type, device.index, dtype)
    if key not in _CACHE:
        timings = (measure or measure_ns_kernels)(device, dtype)
        _CACHE[key] = fastest_kernel(timings)
    return _CACHE[key]


def clear_ns_kernel_cache() -> None:
    """Forget measured choices (tests; or after moving to different hardware in one process)."""
    _CACHE.clear()


def pin_ns_kernel(device: torch.device, dtype: torch.dtype, kernel: str) -> None:
    """Use `kernel` for (device, dtype) from now on in this process, as if it had been measured fastest."""
    if kernel not in NS_KERNELS:
        raise ValueError(f"unknown Newton-Schulz kernel {kernel!r}; valid: {', '.join(NS_KERNELS)}")
    _CACHE[(device.type, device.index, dtype)] = kernel
