"""MuonClip (K2 report, Algorithm 1): Muon for hidden matrices, AdamW for the rest, then per-head QK-Clip.

One object a trainer steps. The trainer collects S_max^h over the step's forwards (all micro-batches) in its
own `openk2.model.ForwardStats(config, track_max_logits=True)` and hands `stats.max_logits()` to `step()`, which
updates the weights, then clips the heads whose S_max^h exceeded tau and exposes what it did in `last_clip`.
`max_logits_due` says on which steps the probe must run (every step with clipping on; a cadence for runs that
only log), and `ClipWindow` gathers the clipping telemetry between two logged records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from openk2.optim.param_groups import ADAMW_BETAS, ADAMW_EPS, MuonFilter, build_optimizers
from openk2.optim.qk_clip import QKClip, reduce_max_logits, unrecorded_max_logits


def max_logits_due(step: int, tau: float | None, every: int = 1) -> bool:
    """Whether step `step` (1-based) needs the max-logit probe: every step while QK-Clip is on (tau set: clipping
    reads it); with QK-Clip off only for logging, every `every` steps (0: never)."""
    if every < 0:
        raise ValueError(f"max_logit_every must be >= 0, got {every}")
    if tau is not None:
        return True
    return every > 0 and step % every == 0


@dataclass
class ClipStats:
    """What QK-Clip did on the last step."""

    max_logits: torch.Tensor  # [L, H] S_max^h seen during the step's forwards (after the cross-rank MAX)
    gamma: torch.Tensor  # [L, H] applied factors, 1 = untouched

    @property
    def num_clipped(self) -> int:
        return int((self.gamma < 1).sum())

    @property
    def min_gamma(self) -> float:
        return float(self.gamma.min())

    @property
    def max_logit(self) -> float:
        return float(self.max_logits.max())

    @property
    def probed(self) -> bool:
        """Whether any max logit was recorded this step (False on steps the probe cadence skipped)."""
        return bool(torch.isfinite(self.max_logits).any())

    def as_dict(self) -> dict[str, Any]:
        """The step's telemetry: clipped heads (count, share, per layer), and, when probed, the max logits."""
        record: dict[str, Any] = {
            "clipped_heads": self.num_clipped, "clipped_share": self.num_clipped / self.gamma.numel(),
            "clipped_heads_per_layer": (self.gamma < 1).sum(dim=1).tolist(), "min_gamma": self.min_gamma}
        if self.probed:
            record.update(max_logit=self.max_logit, max_logit_per_layer=self.max_logits.amax(dim=1).tolist())
        return record


class ClipWindow:
    """QK-Clip activity between two logged records (the trainer logs every `log_every` steps): which heads
    were clipped at any step of the window and at which steps, so a run's "heads ever clipped" and "last
    clipped step" (K2 report, Figure 3 / Appendix D) are exact from the logged records alone."""

    def __init__(self) -> None:
        self.heads: set[tuple[int, int]] = set()
        self.steps: list[int] = []

    def add(self, step: int, clip: ClipStats) -> None:
        """Fold in one step's ClipStats."""
        clipped = (clip.gamma < 1).nonzero().tolist()
        if clipped:
            self.heads.update((int(layer), int(head)) for layer, head in clipped)
            self.steps.append(step)

    def pop(self) -> dict[str, Any]:
        """The window's record fields (`window_clipped_heads` [[layer, head], ...], `window_clip_steps`); resets."""
        record = {"window_clipped_heads": sorted([layer, head] for layer, head in self.heads),
                  "window_clip_steps": list(self.steps)}
        self.heads, self.steps = set(), []
        return record


class MuonClip:
    """Muon + AdamW + QK-Clip behind one `step()` / `zero_grad()` / `state_dict()`."""

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        weight_decay: float = 0.1,
        tau: float | None = 100.0,
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        rms_scale: float = 0.2,
        ns_dtype: torch.dtype = torch.bfloat16,
        muon_filter: MuonFilter | None = None,
        use_muon: bool = True,
        process_group=None,
    ) -> None:
        self.model = model
        if use_muon:
            self.muon, self.adamw = build_optimizers(
                model, lr, weight_decay, muon_filter, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                rms_scale=rms_scale, ns_dtype=ns_dtype,
            )
        else:  # the AdamW baseline (everything on AdamW), with QK-Clip and the probe still available
            self.muon = None
            self.adamw = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                           betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=weight_decay)
        # tau=None gives vanilla Muon; max logits handed to step() are still reduced and reported for logging.
        self.qk_clip = QKClip(model, tau=tau, process_group=process_group) if tau is not None else None
        self.tau = tau
        self.process_group = process_group
        self.last_clip: ClipStats | None = None

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        return (self.adamw,) if self.muon is None else (self.muon, self.adamw)

    @property
    def lr(self) -> float:
        return self.adamw.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of both optimizers (they share one, as in the report)."""
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, max_logits: torch.Tensor | None = None) -> ClipStats:
        """Update all weights, then QK-Clip with the step's max logits [L, H] (a caller's
        `ForwardStats.max_logits()`; None: nothing recorded, so nothing is clipped)."""
        for opt in self.optimizers:
            opt.step()
        if max_logits is None:
            max_logits = unrecorded_max_logits(self.model.config)
        max_logits = reduce_max_logits(max_logits, self.process_group)
        if self.qk_clip is not None:
            gamma = self.qk_clip.apply(max_logits, reduce=False)
        else:
            gamma = torch.ones_like(max_logits)
        self.last_clip = ClipStats(max_logits=max_logits, gamma=gamma)
        return self.last_clip

    def skip_step(self) -> None:
        """Drop a step's gradients without updating (used when a loss is bad; its max logits are the caller's)."""
        self.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        muon = None if self.muon is None else self.muon.state_dict()
        return {"muon": muon, "adamw": self.adamw.state_dict(), "tau": self.tau}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["muon"] is None) != (self.muon is None):
            raise ValueError("optimizer state was saved for a different optimizer (Muon vs AdamW-only)")
        if self.muon is not None:
            self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
