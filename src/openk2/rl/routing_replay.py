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

Multi-turn tool episodes (rl/tool_episode.py) run one engine request per turn over the whole conversation so
far. Each turn keeps the rows the earlier turns recorded and adds those of the positions no earlier turn ran:
the previous turn's last token, the environment-written tool text, then its own (`extend_turn_routing`); the
policy's next turn was sampled on top of those experts, so the environment's positions are replayed too. Tool
text appended after the last turn is never fed to the engine: those rows are FREE (`pad_routing`, harmless,
they only precede context tokens). Every sample of a tool group is a request of its own, so a later one reads
the earlier ones' prompt blocks from the prefix cache (-1 rows); `share_cached_rows` fills such rows from the
trajectory of the same engine run that computed the same tokens (the experts the cached latents came from).

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


def extend_turn_routing(traj: Any, routing_PLK: torch.Tensor | None, context_len: int) -> None:
    """Add one tool-episode turn's routing to `traj.routing`, called before the turn's tokens are appended: the
    turn ran `context_len` positions of context (prompt and every earlier token, the environment's too) and adds
    the rows from the first position no earlier turn ran. A turn without a record, or one after a dropped
    record, drops it (replayed everywhere or nowhere)."""
    have = len(traj.routing)
    if routing_PLK is None or (traj.token_ids and not have) or have > context_len - 1 \
            or routing_PLK.shape[0] < context_len - 1:
        traj.routing = []
        return
    traj.routing += routing_PLK[have:].flatten(1).tolist()


def pad_routing(traj: Any) -> None:
    """Complete a tool episode's record with FREE rows for the trailing tool text no turn fed to the engine."""
    if traj.routing:
        traj.routing += [[FREE] * len(traj.routing[0]) for _ in range(expected_rows(traj) - len(traj.routing))]


def share_cached_rows(trajectories: Sequence[Any]) -> int:
    """Fill the FREE rows (prefix-cache hits) of complete records from a trajectory of the same engine run whose
    tokens up to that position are the same and that computed it; returns the rows filled."""
    known: dict[int, list[int]] = {}
    keys: list[list[int] | None] = []
    for traj in trajectories:
        if not traj.routing or len(traj.routing) != expected_rows(traj):
            keys.append(None)
            continue
        seq, h, mine = traj.prompt_ids + traj.token_ids, 0, []
        for p, row in enumerate(traj.routing):
            h = hash((h, seq[p]))  # the prefix seq[: p + 1]; ints and tuples hash the same in every process
            mine.append(h)
            if row[0] != FREE:
                known.setdefault(h, row)
        keys.append(mine)
    filled = 0
    for traj, mine in zip(trajectories, keys, strict=True):
        for p, h in enumerate(mine or ()):
            if traj.routing[p][0] == FREE and h in known:
                traj.routing[p] = known[h]
                filled += 1
    return filled


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


__all__ = ["expected_rows", "extend_routing", "extend_turn_routing", "moe_layer_count", "pad_routing", "replay_tensor",
           "replay_trace", "share_cached_rows"]
