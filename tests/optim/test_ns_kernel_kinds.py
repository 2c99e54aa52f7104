"""The Newton-Schulz kernel choice per CPU kind: the capability rule on mocked capabilities, the real probe on
this CPU, and the real probe on an emulated AVX2-only CPU (ATen and oneDNN capped to AVX2 in a subprocess)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from openk2.optim import ns_kernel
from openk2.optim.newton_schulz import NS_KERNELS
from openk2.optim.ns_kernel import (
    fastest_kernel,
    gemm_kind,
    measure_ns_kernels,
    ns_candidates,
    ns_kernel_timings,
    select_ns_kernel,
)

CPU = torch.device("cpu")
SRC = Path(__file__).resolve().parents[2] / "src"
ALL = tuple(NS_KERNELS)
# Caps ATen's kernel dispatch and oneDNN at AVX2, as on a CPU without AVX-512: torch then finds no oneDNN
# bf16 kernel and runs bf16 GEMMs in ATen's fallback loops (docs/benchmarks.md, "On an emulated AVX2-only CPU").
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    """Each test sees empty choice and timing caches; the process's real ones are left as they were."""
    monkeypatch.setattr(ns_kernel, "_CACHE", {})
    monkeypatch.setattr(ns_kernel, "_TIMINGS", {})


@pytest.mark.parametrize(
    ("onednn", "flags", "dtype", "kind", "candidates"),
    [
        (False, {"avx2": True}, torch.bfloat16, "software", ("emulated", "fp32")),  # AVX2-only
        (False, {"avx512_bf16": True}, torch.bfloat16, "software", ("emulated", "fp32")),  # oneDNN capped by env
        (True, {"avx512_bf16": True}, torch.bfloat16, "avx512_bf16", ALL),  # this machine's kind
        (True, {"avx512_bf16": True, "amx_bf16": True}, torch.bfloat16, "amx", ALL),  # Sapphire Rapids and later
        (True, {"avx512_f": True}, torch.bfloat16, "onednn", ALL),  # AVX-512 without bf16 instructions
        (True, {"avx512_fp16": True, "amx_fp16": False}, torch.float16, "avx512_fp16", ALL),
        (None, {}, torch.bfloat16, "unknown", ALL),  # torch without the oneDNN probe: measure everything
    ],
)
def test_capability_rule_on_mocked_cpus(monkeypatch, onednn, flags, dtype, kind, candidates):
    """The kind follows torch's oneDNN support first, then the cpuinfo flags; only software GEMM drops native."""
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(ns_kernel, "_onednn_supports", lambda d: onednn)
    monkeypatch.setattr(ns_kernel, "_cpu_flags", lambda: flags)
    assert gemm_kind(CPU, dtype) == kind
    assert ns_candidates(CPU, dtype) == candidates


@pytest.mark.parametrize(("var", "value", "kind"), [("ONEDNN_MAX_CPU_ISA", "AVX512_CORE", "onednn"),
                                                   ("DNNL_MAX_CPU_ISA", "avx512_core", "onednn"),
                                                   ("ONEDNN_MAX_CPU_ISA", "ALL", "amx"),
                                                   ("ONEDNN_MAX_CPU_ISA", "", "amx")])
def test_onednn_isa_cap_overrides_the_cpu_flags(monkeypatch, var, value, kind):
    """With oneDNN capped below the hardware (an AVX-512-without-bf16 emulation) the flags are not what runs."""
    for other in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(var, value)
    monkeypatch.setattr(ns_kernel, "_onednn_supports", lambda d: True)
    monkeypatch.setattr(ns_kernel, "_cpu_flags", lambda: {"avx512_bf16": True, "amx_bf16": True})
    assert gemm_kind(CPU, torch.bfloat16) == kind
    assert ns_candidates(CPU, torch.bfloat16) == ALL


def test_non_cpu_devices_measure_every_kernel():
    """CUDA and other devices are not classified by CPU flags: every kernel is a candidate."""
    assert gemm_kind(torch.device("cuda", 0), torch.bfloat16) == "cuda"
    assert gemm_kind(torch.device("meta"), torch.bfloat16) == "unknown"
    assert ns_candidates(torch.device("cuda", 0), torch.bfloat16) == ALL


def test_measure_rejects_unknown_or_no_kernels():
    """An explicit kernel list must name known kernels and not be empty."""
    with pytest.raises(ValueError, match="non-empty subset"):
        measure_ns_kernels(CPU, torch.bfloat16, kernels=["cutlass"])
    with pytest.raises(ValueError, match="non-empty subset"):
        measure_ns_kernels(CPU, torch.bfloat16, kernels=[])


def test_software_gemm_probe_times_only_the_candidates(monkeypatch):
    """With software bf16 GEMM (mocked) the real probe skips native, and the choice is its fastest candidate."""
    monkeypatch.setattr(ns_kernel, "_onednn_supports", lambda d: False)
    choice = select_ns_kernel(CPU, torch.bfloat16,
                              measure=lambda d, t: measure_ns_kernels(d, t, shape=(2, 16, 32), rounds=1))
    timings = ns_kernel_timings(CPU, torch.bfloat16)
    assert set(timings) == {"emulated", "fp32"}
    assert choice == fastest_kernel(timings)


def test_real_probe_on_this_cpu_reaches_the_chooser():
    """The default start-up probe on this CPU: its timings are the ones chosen from, and the choice is their minimum."""
    torch.set_num_threads(1)
    seen: list[dict[str, float]] = []

    def recording(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
        seen.append(measure_ns_kernels(device, dtype))
        return seen[-1]

    choice = select_ns_kernel(CPU, torch.bfloat16, measure=recording)
    assert len(seen) == 1 and ns_kernel_timings(CPU, torch.bfloat16) == seen[0]
    assert tuple(seen[0]) == ns_candidates(CPU, torch.bfloat16)
    assert choice == min(seen[0], key=seen[0].get)
    assert select_ns_kernel(CPU, torch.bfloat16) == choice and ns_kernel_timings(CPU, torch.bfloat16) == seen[0]


_EMULATED_PROBE = """
import json, torch
from openk2.optim.ns_kernel import gemm_kind, measure_ns_kernels, ns_kernel_timings, select_ns_kernel
torch.set_num_threads(1)
cpu, bf16 = torch.device("cpu"), torch.bfloat16
choice = select_ns_kernel(cpu, bf16)  # the real start-up path, as Muon() runs it
every = measure_ns_kernels(cpu, bf16, shape=(2, 64, 128), kernels=("native", "emulated", "fp32"))
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(), "kind": gemm_kind(cpu, bf16),
                  "onednn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(), "choice": choice,
                  "timings": ns_kernel_timings(cpu, bf16), "every": every}))
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not torch.cpu.get_capabilities().get("avx2"),
                    reason="the AVX2 caps need an x86-64 CPU with AVX2")
def test_emulated_avx2_cpu_probe_skips_native_and_picks_its_fastest():
    """Under AVX2 caps torch loses its oneDNN bf16 GEMM, the rule drops native, the probe picks its fastest."""
    env = {**os.environ, **AVX2_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, "-c", _EMULATED_PROBE], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["aten"] == "AVX2" and out["onednn_bf16"] is False  # the caps took effect
    assert out["kind"] == "software"
    assert set(out["timings"]) == {"emulated", "fp32"}
    assert out["choice"] == fastest_kernel(out["timings"])
    # Why native is left out: with software GEMM it measured 24-59x the fp32 kernel at this shape (10-26 ms
    # against 0.42-0.44 ms, docs/benchmarks.md); 4x leaves room for load, which hits the interleaved calls alike.
    every = out["every"]
    assert every["native"] > 4 * min(every["emulated"], every["fp32"]), every
