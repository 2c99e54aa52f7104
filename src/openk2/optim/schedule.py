"""Warmup-Stable-Decay (WSD) learning-rate schedule with an optional final annealing stage."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["WSDConfig", "WSDScheduler", "tokens_to_steps", "wsd_lr"]

Shape = Literal["linear", "cosine"]
_SHAPES = ("linear", "cosine")

# The K2 report (arXiv:2507.20534) gives a global batch of "67M tokens" at 4096-token context; we read
# that as 16384 sequences of 4096 tokens (2**26 = 67,108,864). Pass tokens_per_step to use 67e6 instead.
KIMI_K2_TOKENS_PER_STEP = 16384 * 4096


def tokens_to_steps(tokens: float, tokens_per_step: int) -> int:
    """Number of optimizer steps needed to consume `tokens` (rounded up)."""
    if tokens_per_step <= 0:
        raise ValueError(f"tokens_per_step must be > 0, got {tokens_per_step}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    return math.ceil(tokens / tokens_per_step)


@dataclass(frozen=True, kw_only=True)
class WSDConfig:
    """Stage lengths (in steps) and learning rates of a WSD schedule; all lrs are absolute."""

    peak_lr: float
    warmup_steps: int
    stable_steps: int
    decay_steps: int
    decay_floor: float
    anneal_steps: int = 0
    anneal_floor: float | None = None
    warmup_start: float = 0.0  # warm-up starts at warmup_start * peak_lr
    decay_shape: Shape = "cosine"
    anneal_shape: Shape = "linear"

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "stable_steps", "decay_steps", "anneal_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not self.peak_lr > 0:
            raise ValueError(f"peak_lr must be > 0, got {self.peak_lr}")
        if not 0 <= self.decay_floor <= self.peak_lr:
            raise ValueError(f"decay_floor must be in [0, peak_lr], got {self.decay_floor}")
        if self.anneal_floor is not None and not 0 <= self.anneal_floor <= self.decay_floor:
            raise ValueError(f"anneal_floor must be in [0, decay_floor], got {self.anneal_floor}")
        if self.anneal_steps > 0 and self.anneal_floor is None:
            raise ValueError("anneal_floor is required when anneal_steps > 0")
        if not 0 <= self.warmup_start <= 1:
            raise ValueError(f"warmup_start must be in [0, 1], got {self.warmup_start}")
        for name in ("decay_shape", "anneal_shape"):
            if getattr(self, name) not in _SHAPES:
                raise ValueError(f"{name} must be one of {_SHAPES}, got {getattr(self, name)!r}")

    @property
    def total_steps(self) -> int:
        """Steps until the schedule reaches its final, held value."""
        return self.warmup_steps + self.stable_steps + self.decay_steps + self.anneal_steps

    @property
    def final_lr(self) -> float:
        """The lr held after the last stage."""
        if self.anneal_steps == 0 or self.anneal_floor is None:
            return self.decay_floor
        return self.anneal_floor

    @classmethod
    def from_tokens(
        cls,
        *,
        tokens_per_step: int,
        peak_lr: float,
        warmup_steps: int,
        stable_tokens: float,
        decay_tokens: float,
        decay_floor: float,
        anneal_tokens: float = 0,
        anneal_floor: float | None = None,
        **kwargs: Any,
    ) -> WSDConfig:
        """Build a config whose stable, decay and anneal stages are given in tokens."""
        return cls(
            peak_lr=peak_lr,
            warmup_steps=warmup_steps,
            stable_steps=tokens_to_steps(stable_tokens, tokens_per_step),
            decay_steps=tokens_to_steps(decay_tokens, tokens_per_step),
            decay_floor=decay_floor,
            anneal_steps=tokens_to_steps(anneal_tokens, tokens_per_step),
            anneal_floor=anneal_floor,
            **kwargs,
        )

    @classmethod
    def kimi_k2(cls, tokens_per_step: int = KIMI_K2_TOKENS_PER_STEP) -> WSDConfig:
        """K2 pre-training: 500 warm-up steps, 2e-4 to 10T, cosine to 2e-5 over 5.5T, anneal to 7e-6."""
        warmup_steps = 500
        # "The first 10T tokens were trained with a constant learning rate of 2e-4 after a 500-step
        # warm-up": the 10T count the warm-up tokens, so the stable stage is 10T minus those.
        stable_steps = tokens_to_steps(10e12, tokens_per_step) - warmup_steps
        return cls(
            peak_lr=2e-4,
            warmup_steps=warmup_steps,
            stable_steps=stable_steps,
            decay_steps=tokens_to_steps(5.5e12, tokens_per_step),
            decay_floor=2e-5,
            anneal_steps=tokens_to_steps(400e9, tokens_per_step),
            anneal_floor=7e-6,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (safe for torch.load(weights_only=True))."""
        return dataclasses.asdict(self)


def _interpolate(start: float, end: float, frac: float, shape: Shape) -> float:
    """Go from start (frac=0) to end (frac=1) along a linear or half-cosine curve."""
    if shape == "cosine":
        frac = 0.5 * (1 - math.cos(math.pi * frac))
    return start + (end - start) * frac


def wsd_lr(step: int, cfg: WSDConfig) -> float:
    """Learning rate at optimizer step `step` (0-based) under the WSD schedule `cfg`."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < cfg.warmup_steps:
        return _interpolate(cfg.warmup_start * cfg.peak_lr, cfg.peak_lr, step / cfg.warmup_steps, "linear")
    step -= cfg.warmup_steps
    if step < cfg.stable_steps:
        return cfg.peak_lr
    step -= cfg.stable_steps
    if step < cfg.decay_steps:
        return _interpolate(cfg.peak_lr, cfg.decay_floor, step / cfg.decay_steps, cfg.decay_shape)
    step -= cfg.decay_steps
    if step < cfg.anneal_steps:
        return _interpolate(cfg.decay_floor, cfg.final_lr, step / cfg.anneal_steps, cfg.anneal_shape)
    return cfg.final_lr


class WSDScheduler(LRScheduler):
    """Set every param group's lr to wsd_lr(step, cfg); use one per optimizer (e.g. Muon and AdamW)."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: WSDConfig, last_epoch: int = -1) -> None:
        self.cfg = cfg
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        """Learning rates for the current step (self.last_epoch)."""
        return [wsd_lr(self.last_epoch, self.cfg)] * len(self.optimizer.param_groups)

    def _get_closed_form_lr(self) -> list[float]:
        """Same as get_lr: the schedule is a closed form of the step."""
        return self.get_lr()

    def state_dict(self) -> dict[str, Any]:
        """Scheduler state with the config as a plain dict, so weights_only loading works."""
        state = super().state_dict()
        state["cfg"] = self.cfg.to_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore scheduler state, including its config."""
        state = dict(state_dict)
        state["cfg"] = WSDConfig(**state["cfg"])
        super().load_state_dict(state)
