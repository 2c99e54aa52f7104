"""Tests for the Newton-Schulz kernel choice: the selection logic on given timings, caching, and Muon's use of it."""

from __future__ import annotations

import math

import pytest
import torch

from openk2.optim import ns_kernel
from openk2.optim.muon import Muon, zeropower_via_newtonschulz5
from openk2.optim.newton_schulz import NS_KERNELS, newton_schulz
from openk2.optim.ns_kernel import fastest_kernel, measure_ns_kernels, select_ns_kernel

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    """Each test sees empty choice and timing caches, and the process's real ones are left as they were."""
    monkeypatch.setattr(ns_kernel, "_CACHE", {})
    monkeypatch.setattr(ns_kernel, "_TIMINGS", {})


class FakeMeasure:
    """A measurement that returns fixed timings and counts its calls."""

    def __init__(self, timings: dict[str, float]) -> None:
        self.timings = timings
        self.calls = 0

    def __call__(self, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
        self.calls += 1
        return dict(self.timings)


@pytest.mark.parametrize(
    ("timings", "expected"),
    [
        ({"native": 0.3, "emulated": 0.7, "fp32": 0.6}, "native"),  # avx512_bf16: bf16 GEMM units
        ({"native": 5.0, "emulated": 0.4, "fp32": 0.5}, "emulated"),  # AVX2-only: bf16 GEMM emulated in software
        ({"native": 5.0, "emulated": 0.6, "fp32": 0.4}, "fp32"),
        ({"native": 0.5, "emulated": 0.5, "fp32": 0.5}, "native"),  # ties go to native
        ({"emulated": 0.5, "fp32": 0.5}, "emulated"),
    ],
)
def test_fastest_kernel_picks_the_smallest_time(timings, expected):
    """The choice is the measured-fastest kernel, with a fixed order on ties."""
    assert fastest_kernel(timings) == expected


def test_fastest_kernel_rejects_empty_timings():
    """No known kernel among the timings is a ValueError, not a silent default."""
    with pytest.raises(ValueError, match="no timings"):
        fastest_kernel({"cutlass": 0.1})


def test_select_measures_once_per_device_and_dtype():
    """The first call measures; later calls for the same (device, dtype) reuse the cached choice."""
    fake = FakeMeasure({"native": 2.0, "emulated": 1.0, "fp32": 3.0})
    assert select_ns_kernel(CPU, torch.bfloat16, measure=fake) == "emulated"
    fake.timings = {"native": 0.1, "emulated": 1.0, "fp32": 3.0}  # would now pick native, but is not asked
    assert select_ns_kernel(CPU, torch.bfloat16, measure=fake) == "emulated"
    assert fake.calls == 1
    assert select_ns_kernel(CPU, torch.float16, measure=fake) == "native"  # another dtype: measured anew
    assert fake.calls == 2
    ns_kernel.clear_ns_kernel_cache()
    assert select_ns_kernel(CPU, torch.bfloat16, measure=fake) == "native"
    assert fake.calls == 3


def test_select_does_not_measure_for_fp32():
    """With an fp32 Newton-Schulz dtype every kernel is the same arithmetic: no measurement."""
    fake = FakeMeasure({"native": 9.0, "emulated": 1.0, "fp32": 1.0})
    assert select_ns_kernel(CPU, torch.float32, measure=fake) == "native"
    assert fake.calls == 0


def test_real_measurement_times_every_kernel():
    """The real probe returns a positive, finite time for each kernel."""
    torch.set_num_threads(1)
    timings = measure_ns_kernels(CPU, torch.bfloat16, shape=(2, 16, 32), rounds=1)
    assert set(timings) == set(NS_KERNELS)
    assert all(0.0 < t < math.inf for t in timings.values())
    assert fastest_kernel(timings) in NS_KERNELS


@pytest.mark.parametrize("kernel", sorted(NS_KERNELS))
def test_muon_default_uses_the_selected_kernel(kernel):
    """Muon with no kernel given steps exactly like Muon pinned to the kernel the selection picked."""
    timings = {k: (0.1 if k == kernel else 1.0) for k in NS_KERNELS}
    ns_kernel._CACHE[(CPU.type, CPU.index, torch.bfloat16)] = fastest_kernel(timings)
    gen = torch.Generator().manual_seed(0)
    shapes = [(24, 40), (3, 16, 32)]
    auto = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    pinned = [torch.nn.Parameter(p.detach().clone()) for p in auto]
    for p, q in zip(auto, pinned, strict=True):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    Muon(auto, lr=0.02).step()
    Muon(pinned, lr=0.02, ns_kernel=kernel).step()
    for p, q in zip(auto, pinned, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    X = torch.randn(16, 32, generator=gen)
    torch.testing.assert_close(zeropower_via_newtonschulz5(X), zeropower_via_newtonschulz5(X, kernel=kernel),
                               rtol=0, atol=0)


def test_kernel_names_are_checked():
    """Unknown kernel names and giving both ns_kernel and ns_emulate are ValueErrors."""
    (p,) = [torch.nn.Parameter(torch.randn(8, 8))]
    with pytest.raises(ValueError, match="unknown ns_kernel"):
        Muon([p], lr=0.1, ns_kernel="cublas")
    with pytest.raises(ValueError, match="not both"):
        Muon([p], lr=0.1, ns_kernel="native", ns_emulate=True)
    with pytest.raises(ValueError, match="unknown Newton-Schulz kernel"):
        zeropower_via_newtonschulz5(torch.randn(8, 8), kernel="cublas")
    with pytest.raises(ValueError, match="unknown Newton-Schulz kernel"):
        newton_schulz(torch.randn(1, 8, 8), 5, torch.bfloat16, "cublas")


def test_fp32_kernel_overwrite_uses_the_input_as_scratch_only_when_allowed():
    """overwrite=False leaves the input alone for every kernel; the fp32 kernel's result matches either way."""
    X = torch.randn(3, 16, 24, generator=torch.Generator().manual_seed(0))
    before = X.clone()
    for kernel in NS_KERNELS:
        newton_schulz(X, 5, torch.bfloat16, kernel)
        torch.testing.assert_close(X, before, rtol=0, atol=0)
    kept = newton_schulz(X, 5, torch.bfloat16, "fp32")
    torch.testing.assert_close(newton_schulz(X.clone(), 5, torch.bfloat16, "fp32", overwrite=True), kept,
                               rtol=0, atol=0)


def test_legacy_emulate_flag_maps_to_kernel_names():
    """emulate=True / False are the emulated / native kernels, bit for bit."""
    X = torch.randn(16, 40, generator=torch.Generator().manual_seed(0))
    for emulate, kernel in ((True, "emulated"), (False, "native")):
        torch.testing.assert_close(zeropower_via_newtonschulz5(X, emulate=emulate),
                                   zeropower_via_newtonschulz5(X, kernel=kernel), rtol=0, atol=0)
