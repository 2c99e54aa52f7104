"""Seeding and capture/restore of every global RNG a run draws from: Python's `random`, numpy's global
generator, torch on the CPU and, where CUDA is available, torch on every CUDA device.

Every trainer seeds with `seed_everything` and puts `capture_rng_state()` into its checkpoints (pre-training
and SFT per rank in the DCP checkpoint's `ranks/rank-NNNNN.pt`; the RL trainer as `rng.pt` via `save_rng_state`);
resuming calls `restore_rng_state` (or `load_rng_state`), so a resumed run draws what the uninterrupted one
would have drawn. A foundation module: nothing from openk2.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

RNG_FILE = "rng.pt"  # the RNG states in an RL checkpoint directory


def seed_everything(seed: int) -> None:
    """Seed Python's `random`, numpy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device (lazily, when CUDA is initialised)


def capture_rng_state() -> dict[str, Any]:
    """The state of every global RNG: keys `python`, `numpy`, `torch` and, with CUDA, `cuda` (one state per
    device)."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back a `capture_rng_state()` result. CUDA states are restored for the devices present (a state saved
    without CUDA, or with fewer devices, leaves the other devices as they are)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def save_rng_state(path: str | Path) -> None:
    """Write `capture_rng_state()` to `path` (a checkpoint's `rng.pt`)."""
    torch.save(capture_rng_state(), path)


def load_rng_state(path: str | Path) -> None:
    """Restore the RNG states that `save_rng_state` wrote to `path`."""
    restore_rng_state(torch.load(path, weights_only=False))


__all__ = ["RNG_FILE", "capture_rng_state", "load_rng_state", "restore_rng_state", "save_rng_state",
           "seed_everything"]
