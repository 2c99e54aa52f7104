"""Split a model's parameters between Muon (hidden matrices) and AdamW (everything else)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.optim import AdamW

from openk2.optim.muon import Muon

__all__ = ["ADAMW_BETAS", "ADAMW_EPS", "build_optimizers", "default_muon_filter", "param_groups"]

ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8

MuonFilter = Callable[[str, nn.Parameter], bool]


def default_muon_filter(name: str, param: nn.Parameter) -> bool:
    """Muon for hidden matrices and expert stacks (ndim >= 2) except embeddings and the output head."""
    # Embedding rows and lm_head rows are looked up / read out one token at a time, so they are not
    # the dense linear maps whose spectral norm Muon controls; Moonlight and K2 keep them on AdamW.
    return param.ndim >= 2 and "embed" not in name and "lm_head" not in name


def param_groups(
    model: nn.Module, lr: float, weight_decay: float, muon_filter: MuonFilter | None = None
) -> list[dict[str, Any]]:
    """Return [muon_group, adamw_group] of the model's trainable parameters, tagged with use_muon."""
    keep = muon_filter or default_muon_filter
    groups: dict[bool, dict[str, Any]] = {
        use_muon: {
            "params": [],
            "param_names": [],
            "use_muon": use_muon,
            "lr": lr,
            "weight_decay": weight_decay,
        }
        for use_muon in (True, False)
    }
    # named_parameters() yields a tied parameter once, so it can't land in both optimizers.
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        group = groups[bool(keep(name, param))]
        group["params"].append(param)
        group["param_names"].append(name)
    return [groups[True], groups[False]]


def build_optimizers(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    muon_filter: MuonFilter | None = None,
    **muon_kwargs: Any,
) -> tuple[Muon, AdamW]:
    """Build the Muon and AdamW optimizers for a model, sharing lr and weight decay."""
    muon_group, adamw_group = param_groups(model, lr, weight_decay, muon_filter)
    for group, kind in ((muon_group, "Muon"), (adamw_group, "AdamW")):
        if not group["params"]:
            raise ValueError(f"the model has no trainable parameters for {kind} under this muon_filter")
    muon = Muon([muon_group], lr=lr, weight_decay=weight_decay, **muon_kwargs)
    adamw = AdamW([adamw_group], lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=weight_decay)
    return muon, adamw
