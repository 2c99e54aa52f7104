"""Pick the Newton-Schulz kernel by a short measurement on the machine at hand, once per process.

Which kernel is fastest is a property of the hardware, not of the device type: on AVX2-only CPUs bf16
GEMM runs 5-50x slower than fp32 (emulating wins), on avx512_bf16 / AMX CPUs and GPUs the native bf16
kernels win (measured in docs/benchmarks.md). So instead of assuming, `select_ns_kernel` times the
candidate kernels on a small probe batch the first time a (device, dtype) pair is seen and caches the
winner. One capability rule narrows the candidates: where torch has no oneDNN kernel for the dtype
(`gemm_kind` "software", e.g. AVX2-only CPUs), its GEMM runs in ATen's fallback loops, measured 17-19x
slower than the fp32 kernel at the probe shape, so the native kernel is not worth the ~2 s of timing there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from openk2.optim.newton_schulz import NS_KERNELS, newton_schulz

__all__ = [
    "clear_ns_kernel_cache", "fastest_kernel", "gemm_kind", "measure_ns_kernels", "ns_candidates",
    "ns_kernel_timings", "pin_ns_kernel", "select_ns_kernel",
]

# Preference on equal times: the native kernel is what torch.optim.Muon and GPUs compute.
_PREFERENCE = ("native", "emulated", "fp32")
# A probe like a K2 tiny-preset expert stack (moe_intermediate 128 x hidden 256): ~0.8 GFLOP per kernel
# call, 5-20 ms on one CPU core, so the whole measurement stays well under a second.
PROBE_SHAPE = (8, 128, 256)
PROBE_ROUNDS = 3
# The cpuinfo flag (torch.cpu.get_capabilities) that marks native instructions for a dtype's products.
_AMX_FLAG = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}
_AVX512_FLAG = {torch.bfloat16: "avx512_bf16", torch.float16: "avx512_fp16"}
# Environment variables that cap the instruction set oneDNN uses (oneDNN's docs: dev_guide_cpu_dispatcher_control).
_ONEDNN_ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")

Key = tuple[str, int | None, torch.dtype]
_CACHE: dict[Key, str] = {}
_TIMINGS: dict[Key, dict[str, float]] = {}
Measure = Callable[[torch.device, torch.dtype], Mapping[str, float]]


def _onednn_supports(dtype: torch.dtype) -> bool | None:
    """Whether torch runs `dtype` CPU GEMMs through oneDNN (it honours ONEDNN_MAX_CPU_ISA); None if unknown."""
    probes = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    if dtype not in probes:
        return None
    try:
        return bool(getattr(torch.ops.mkldnn, probes[dtype])())
    except (AttributeError, RuntimeError):
        return None


def _cpu_flags() -> Mapping[str, object]:
    """The CPU's instruction-set flags as cpuinfo reports them (hardware, not the ISA caps set by env vars)."""
    try:
        return torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):
        return {}


def gemm_kind(device: torch.device, dtype: torch.dtype) -> str:
    """How `dtype` matrix products run: cuda, amx, avx512_bf16/_fp16, onednn, software, or unknown."""
    if device.type == "cuda":
        return "cuda"
    if device.type != "cpu":
        return "unknown"
    onednn = _onednn_supports(dtype)
    if onednn is None:
        return "unknown"
    if not onednn:
        return "software"  # ATen's own fallback loops: no bf16/fp16 GEMM units used (e.g. AVX2-only CPUs)
    if any((os.environ.get(v) or "ALL").upper() != "ALL" for v in _ONEDNN_ISA_CAPS):
        return "onednn"  # oneDNN capped below the hardware: the cpuinfo flags no longer say what runs
    flags = _cpu_flags()
    if flags.get(_AMX_FLAG.get(dtype, "")):
        return "amx"
    if flags.get(_AVX512_FLAG.get(dtype, "")):
        return _AVX512_FLAG[dtype]
    return "onednn"  # oneDNN without native instructions for the dtype (e.g. avx512_core converts bf16 itself)


def ns_candidates(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The kernels worth timing for (device, dtype): all of them, less native where its GEMM is software."""
    if gemm_kind(device, dtype) == "software":
        return tuple(k for k in NS_KERNELS if k != "native")
    return tuple(NS_KERNELS)


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
    kernels: Sequence[str] | None = None,
) -> dict[str, float]:
    """Seconds per call of each kernel (default: `ns_candidates`) on a random probe batch, best of `rounds`."""
    kernels = tuple(ns_candidates(device, dtype) if kernels is None else kernels)
    unknown = [k for k in kernels if k not in NS_KERNELS]
    if unknown or not kernels:
        raise ValueError(f"kernels must be a non-empty subset of {', '.join(NS_KERNELS)}, got {list(kernels)}")
    X = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
    for kernel in kernels:  # warm-up: library initialisation and first-touch page faults
        newton_schulz(X, steps, dtype, kernel)
    best = dict.fromkeys(kernels, float("inf"))
    # Interleaved rounds and the minimum: load from other processes only ever adds time.
    for _ in range(rounds):
        for kernel in kernels:
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
        timings = dict((measure or measure_ns_kernels)(device, dtype))
        _CACHE[key] = fastest_kernel(timings)
        _TIMINGS[key] = timings
    return _CACHE[key]


def ns_kernel_timings(device: torch.device, dtype: torch.dtype) -> dict[str, float] | None:
    """The probe timings (seconds) that `select_ns_kernel` chose from, or None if it measured nothing."""
    timings = _TIMINGS.get((device.type, device.index, dtype))
    return dict(timings) if timings is not None else None


def clear_ns_kernel_cache() -> None:
    """Forget measured choices (tests; or after moving to different hardware in one process)."""
    _CACHE.clear()
    _TIMINGS.clear()


def pin_ns_kernel(device: torch.device, dtype: torch.dtype, kernel: str) -> None:
    """Use `kernel` for (device, dtype) from now on in this process, as if it had been measured fastest."""
    if kernel not in NS_KERNELS:
        raise ValueError(f"unknown Newton-Schulz kernel {kernel!r}; valid: {', '.join(NS_KERNELS)}")
    key = (device.type, device.index, dtype)
    _CACHE[key] = kernel
    _TIMINGS.pop(key, None)
