"""Engine switching on a GPU (K2 report 4.2): the training state leaves the device while the rollout runs.

Colocated on one GPU, the training engine's parameters, gradients and optimizer state would sit idle in device
memory during the rollout phase, next to the inference copy and its KV cache. `TrainingStateOffload` moves
them to host memory before the rollout (D2H) and back after it (H2D), every tensor to the device it came from
(AdamW keeps its `step` counters on the CPU: they stay there). Parameters keep their identity (`p.data` is
swapped), so the optimizer's references stay valid. On a machine without CUDA, or with a policy on the CPU,
both calls do nothing: host and "device" memory are the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def _optimizers(optimizer) -> tuple[torch.optim.Optimizer, ...]:
    """The torch optimizers inside `optimizer` (MuonClip holds a Muon and an AdamW)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    return tuple(o for o in getattr(optimizer, "optimizers", ()) if o is not None)


class TrainingStateOffload:
    """Moves a policy's parameters and gradients and its optimizer's state to the CPU and back."""

    def __init__(self, policy: torch.nn.Module, optimizer) -> None:
        self.policy, self.optimizer = policy, optimizer
        self._homes: list[tuple[dict, str, torch.device]] | None = None  # optimizer-state tensors moved
        self._param_home: torch.device | None = None

    @property
    def active(self) -> bool:
        """Whether offloading does anything here: CUDA is available and the policy lives on it."""
        if not torch.cuda.is_available():
            return False
        first = next(self.policy.parameters(), None)
        return first is not None and first.device.type == "cuda"

    @torch.no_grad()
    def offload(self) -> bool:
        """Training state to pinned host memory; returns whether anything moved."""
        if self._homes is not None or not self.active:
            return False
        self._param_home = next(self.policy.parameters()).device
        self._homes = []
        for opt in _optimizers(self.optimizer):
            for state in opt.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.device.type == "cuda":
                        self._homes.append((state, key, value.device))
                        state[key] = value.to("cpu", non_blocking=True).pin_memory()
        for p in self.policy.parameters():
            p.data = p.data.to("cpu", non_blocking=True).pin_memory()
            if p.grad is not None:
                p.grad = p.grad.to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # hand the freed blocks back so the rollout's KV cache can take them
        return True

    @torch.no_grad()
    def reload(self) -> bool:
        """Training state back to where `offload` found it; returns whether anything moved."""
        if self._homes is None:
            return False
        home = self._param_home
        for p in self.policy.parameters():
            p.data = p.data.to(home, non_blocking=True)
            if p.grad is not None:
                p.grad = p.grad.to(home, non_blocking=True)
        for state, key, device in self._homes:
            state[key] = state[key].to(device, non_blocking=True)
        torch.cuda.synchronize()
        self._homes, self._param_home = None, None
        return True

    @contextmanager
    def during_rollout(self) -> Iterator[bool]:
        """`with offload.during_rollout():` the training state is off the device inside the block."""
        moved = self.offload()
        try:
            yield moved
        finally:
            self.reload()


__all__ = ["TrainingStateOffload"]
