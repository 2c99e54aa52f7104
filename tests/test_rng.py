"""openk2.rng: seeding and capture/restore of every global RNG (Python, numpy, torch CPU, CUDA when present)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from openk2.rng import capture_rng_state, load_rng_state, restore_rng_state, save_rng_state, seed_everything


def _draw() -> tuple:
    cuda = torch.rand(3, device="cuda").tolist() if torch.cuda.is_available() else None
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), torch.randn(2).tolist(), cuda


def test_capture_draw_restore_draw_is_identical():
    seed_everything(123)
    _draw()  # move every generator off its seeded start
    state = capture_rng_state()
    first = _draw()
    assert _draw() != first
    restore_rng_state(state)
    assert _draw() == first
    assert set(state) == {"python", "numpy", "torch", *(["cuda"] if torch.cuda.is_available() else [])}


def test_seed_everything_is_reproducible():
    seed_everything(7)
    a = _draw()
    seed_everything(7)
    assert _draw() == a
    seed_everything(8)
    assert _draw() != a


def test_state_file_round_trip(tmp_path):
    seed_everything(0)
    save_rng_state(tmp_path / "rng.pt")
    first = _draw()
    load_rng_state(tmp_path / "rng.pt")
    assert _draw() == first


def test_a_state_without_cuda_restores_the_rest():
    seed_everything(1)
    state = {k: v for k, v in capture_rng_state().items() if k != "cuda"}  # e.g. written on a CPU-only machine
    first = _draw()[:4]
    restore_rng_state(state)
    assert _draw()[:4] == first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_is_captured_per_device():
    state = capture_rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
