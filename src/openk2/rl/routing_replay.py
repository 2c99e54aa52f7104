"""Rollout routing replay (R3) on the RL side: keep the experts the rollout engine ran for every position of a
trajectory, and turn them into the replay of a training forward over prompt + response.

The engine (`Engine(record_routing=True)`) gives each result the experts [P+G-1, L, K] its MoE layers ran
for every input position of prompt + response (the last token is never fed back, so it has none; -1 rows
are positions served from its prefix cache, which keeps no routing, and they route freely in training). A
trajectory keeps them per position, each flattened to L*K ints so that paused groups stay JSON in
checkpoints. Across partial-rollout segments it keeps the first segment's rows and, from each later one, only
the rows of the positions that segment sampled from: a resumed segment re-prefills the earlier response
under new weights, but the tokens there were sampled, and their log-probs taken, through the earlier
segment's experts. In training, the packed batch (prompt + response, right-padded) replays every recorded
position; the final token and the padding route by themselves (FREE). Gate weights still come from the
training router's own scores (model/routing.py), so the router keeps its gradient.

Shape legend: N trajectories, T packed width, P prompt tokens, G response tokens, L MoE layers, K experts per
token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from openk2.config import ModelConfig
from openk2.model.routing import FREE, RoutingTrace


def moe_layer_count(config: ModelConfig) -> int:
    """Number of MoE layers in `config` (0 for a dense model)."""
    return sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))


def expected_rows(traj: Any) -> int:
    """Positions a complete record of `traj` covers: every input of prompt + response but the last token."""
    return len(traj.prompt_ids) + len(traj.token_ids) - 1


def extend_routing(traj: Any, routing_PLK: torch.Tensor | None, prompt_len: int) -> None:
    """Add one engine segment's routing to `traj.routing`, called before its tokens are appended: the segment
    ran prompt_len = P + (tokens so far) positions of context; a first segment contributes all its rows, a
    resumed one only those from position prompt_len - 1 on. A gap (a segment without a record) drops the record,
    so a trajectory is replayed either everywhere or nowhere."""
    if routing_PLK is None or len(traj.routing) != (prompt_len - 1 if traj.token_ids else 0):
        traj.routing = []
        return
    start = prompt_len - 1 if traj.token_ids else 0
    traj.routing += routing_PLK[start:].flatten(1).tolist()


def replay_tensor(trajectories: Sequence[Any], config: ModelConfig) -> torch.Tensor:
    """[N, T, L, K] int64 experts to replay for the packed batch: each trajectory's record from position 0, FREE
    after it and for trajectories without a complete record."""
    layers, k = moe_layer_count(config), config.num_experts_per_tok
    width = max(len(t.prompt_ids) + len(t.token_ids) for t in trajectories)
    out = torch.full((len(trajectories), width, layers, k), FREE, dtype=torch.long)
    for b, traj in enumerate(trajectories):
        routing = getattr(traj, "routing", None) or []
        if routing and len(routing) == expected_rows(traj):
            out[b, : len(routing)] = torch.tensor(routing, dtype=torch.long).view(-1, layers, k)
    return out


def replay_trace(trajectories: Sequence[Any], config: ModelConfig) -> RoutingTrace | None:
    """A RoutingTrace replaying the trajectories' recorded experts in the packed training forward, or None for
    a dense model or when no trajectory carries a record (the forward then routes as usual)."""
    if moe_layer_count(config) == 0 or not any(getattr(t, "routing", None) for t in trajectories):
        return None
    return RoutingTrace(config, replay=replay_tensor(trajectories, config))


__all__ = ["expected_rows", "extend_routing", "moe_layer_count", "replay_tensor", "replay_trace"]
