"""Train/rollout mismatch: how far the training forward's log-probs and experts are from the rollout's.

Per iteration, over the response tokens sampled by the weights the trainer holds now (so policy lag from
partial rollout does not count): the distribution of |log pi_train(y_t) - log pi_rollout(y_t)| (median, p90,
p99, max, mean) and the routing agreement rate, the fraction of the rollout's (token, MoE layer) expert
choices that the training router makes by itself at the same position (positions the rollout engine served
from its prefix cache have no record and do not count). Both are measured twice, with a plain
training forward and with the rollout's routing replayed (R3, rl/routing_replay.py): with replay the experts
used are the rollout's by construction, and the agreement says how many of them the training router would
still have picked given the replayed history. Keys of the record: `logp_diff_{median,p90,p99,max,mean}`,
`route_agree`, `mismatch_tokens`, and the same with a `_r3` suffix for the replayed forward.

Shape legend: N trajectories, T packed width, V vocab, L MoE layers, K experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from openk2.model.routing import RoutingTrace, routing_agreement
from openk2.rl.routing_replay import expected_rows, moe_layer_count, replay_tensor

QUANTILES = {"median": 0.5, "p90": 0.9, "p99": 0.99}


@dataclass
class Mismatch:
    """One forward's mismatch against the rollout over the counted response tokens."""

    tokens: int
    logp_diff: dict[str, float]  # median, p90, p99, max, mean of |log pi_train - log pi_rollout|
    route_agree: float  # nan for a dense model or when no counted token has a routing record

    def record(self, suffix: str = "") -> dict[str, float]:
        """Flat metrics keys (`logp_diff_median`, ..., `route_agree`, `mismatch_tokens`) with `suffix`."""
        out = {f"logp_diff_{name}{suffix}": value for name, value in self.logp_diff.items()}
        out[f"route_agree{suffix}"] = self.route_agree
        out[f"mismatch_tokens{suffix}"] = float(self.tokens)
        return out


def abs_diff_summary(diff: torch.Tensor) -> dict[str, float]:
    """Median, p90, p99, max and mean of |diff| (nan for no tokens).

    >>> abs_diff_summary(torch.tensor([0.0, -1.0, 2.0, -3.0, 4.0]))
    {'median': 2.0, 'p90': 3.6, 'p99': 3.96, 'max': 4.0, 'mean': 2.0}
    """
    if diff.numel() == 0:
        return {name: float("nan") for name in (*QUANTILES, "max", "mean")}
    a = diff.detach().double().abs().flatten()
    out = {name: round(float(torch.quantile(a, q)), 12) for name, q in QUANTILES.items()}
    out.update(max=float(a.max()), mean=float(a.mean()))
    return out


def _pack(trajectories: Sequence[Any], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, T] (prompt + response, right-padded) and the width-T positions of each response token."""
    width = max(len(t.prompt_ids) + len(t.token_ids) for t in trajectories)
    ids = torch.full((len(trajectories), width), pad_id, dtype=torch.long)
    for b, t in enumerate(trajectories):
        seq = list(t.prompt_ids) + list(t.token_ids)
        ids[b, : len(seq)] = torch.tensor(seq)
    return ids, ids[:, 1:]


@torch.no_grad()
def measure(model: torch.nn.Module, trajectories: Sequence[Any], pad_id: int, replay: bool,
            version: int | None = None) -> Mismatch:
    """One no-grad training forward of the trajectories (replaying their recorded routing when `replay`)
    compared with their rollout log-probs and routing; only tokens sampled at policy `version` count (all when
    None)."""
    if not trajectories:
        raise ValueError("measuring the mismatch needs at least one trajectory")
    config = model.config
    layers, k = moe_layer_count(config), config.num_experts_per_tok
    ids_NT, targets_NT = _pack(trajectories, pad_id)
    rollout_routing = replay_tensor(trajectories, config) if layers else None
    trace = None
    if layers:
        trace = RoutingTrace(config, replay=rollout_routing if replay else None)
    device = next(model.parameters()).device
    logits = model(ids_NT.to(device), routing=trace).logits[:, :-1].float()
    logp_NT = logits.log_softmax(-1).gather(-1, targets_NT.to(device)[..., None]).squeeze(-1).cpu()
    diffs, rows_b, rows_t = [], [], []
    for b, t in enumerate(trajectories):
        counted = [j for j in range(len(t.token_ids))  # sampled tokens only (a tool episode's context has mask 0)
                   if (version is None or not t.versions or t.versions[j] == version)
                   and (not getattr(t, "mask", None) or t.mask[j])]
        start = len(t.prompt_ids) - 1
        pos = torch.tensor([start + j for j in counted], dtype=torch.long)
        rollout = torch.tensor([t.logprobs[j] for j in counted], dtype=torch.float64)
        diffs.append(logp_NT[b, pos].double() - rollout)
        if layers and len(getattr(t, "routing", None) or []) == expected_rows(t):
            rows_b += [b] * len(counted)
            rows_t += pos.tolist()
    diff = torch.cat(diffs) if diffs else torch.zeros(0)
    agree = float("nan")
    if rows_b:
        chosen = trace.chosen().view(*ids_NT.shape, layers, k).cpu()
        b_idx, t_idx = torch.tensor(rows_b), torch.tensor(rows_t)
        rollout = rollout_routing[b_idx, t_idx]
        known = (rollout >= 0).flatten(1).all(-1)  # -1: a position the rollout took from its prefix cache
        agree = routing_agreement(rollout, chosen[b_idx, t_idx], known)
    return Mismatch(int(diff.numel()), abs_diff_summary(diff), agree)


def mismatch_record(model: torch.nn.Module, trajectories: Sequence[Any], pad_id: int,
                    version: int | None = None) -> dict[str, float]:
    """Both measurements (plain and R3-replayed training forward) as one flat metrics record."""
    record = measure(model, trajectories, pad_id, replay=False, version=version).record()
    if moe_layer_count(model.config):
        record.update(measure(model, trajectories, pad_id, replay=True, version=version).record("_r3"))
    return record


__all__ = ["Mismatch", "abs_diff_summary", "measure", "mismatch_record"]
