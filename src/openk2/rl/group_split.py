"""Splitting one iteration's rollout groups across rollout workers and merging their results back in the
order one colocated engine would produce, so that a multi-worker rollout trains on the same batch; and the
error a lost or misbehaving worker surfaces as."""

from __future__ import annotations

from collections.abc import Sequence

from openk2.rl.rollout import Group, RolloutStats


class RolloutWorkerError(RuntimeError):
    """A rollout worker died, raised, or did not answer in time (one line naming the worker and the cause)."""


def split_groups(groups: Sequence[Group], num_workers: int) -> list[list[Group]]:
    """Worker w gets the groups with group_id % num_workers == w, in their order (deterministic, and a paused
    group returns to the worker that sampled its first tokens)."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    shares: list[list[Group]] = [[] for _ in range(num_workers)]
    for g in groups:
        shares[g.group_id % num_workers].append(g)
    return shares


def merge_groups(order: Sequence[int], returned: Sequence[Group]) -> tuple[list[Group], list[Group]]:
    """(complete, still paused) groups in the order of `order` (group ids), as one colocated engine would
    return them: PartialRollout.run keeps the paused-then-new order of its input in both lists."""
    by_id = {g.group_id: g for g in returned}
    if sorted(by_id) != sorted(order):
        raise RolloutWorkerError(f"rollout workers returned groups {sorted(by_id)}, expected {sorted(order)}")
    groups = [by_id[i] for i in order]
    return [g for g in groups if g.complete], [g for g in groups if not g.complete]


def merge_stats(stats: Sequence[RolloutStats], completed: int) -> RolloutStats:
    """One iteration's stats from the workers': token and trajectory counts add up; engine steps are the
    slowest worker's (they ran in parallel)."""
    return RolloutStats(sum(s.new_tokens for s in stats), sum(s.paused for s in stats),
                        sum(s.resumed for s in stats), completed, max((s.engine_steps for s in stats), default=0))


__all__ = ["RolloutWorkerError", "merge_groups", "merge_stats", "split_groups"]
