"""Interleaved 1F1B with extra warm-up micro-batches (K2 report, section 2.4: "by increasing warm-up
micro-batches, we overlap EP all-to-all with computation under standard interleaved 1F1B").

torch's ScheduleInterleaved1F1B gives pipeline rank r a warm-up of (v - 1) * per_round + 2 (pp - 1 - r) forwards
(`_get_warmup_ops`) before its first backward. Here each rank runs `extra` more (capped by the m * v forwards it
has), so its steady state keeps that many more stage-micro-batches in flight: while one waits on communication,
another is ready to compute. Only the compute order changes; torch's own lowering (`_add_send_recv`) inserts the
p2p sends/receives and torch's runtime (`_PipelineScheduleRuntime`) executes the lists. Each stage still runs its
micro-batches' forwards and backwards in order 0, 1, ..., so gradients accumulate in the same order as without
the extra warm-up.

Names: v = stages per rank, m = micro-batches per step, per_round = micro-batches per round (torch's flex-PP).
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.pipelining import ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _Action, _ComputationType, _get_1f1b_rank_ops, _get_warmup_ops


def microbatches_per_round(pp: int, num_microbatches: int) -> int:
    """Micro-batches per round of torch's interleaved schedules (m must be a multiple of max(1, m // pp))."""
    rounds = max(1, num_microbatches // pp)
    if num_microbatches % rounds:
        raise ValueError(f"interleaved 1F1B needs train.grad_accum to be a multiple of {rounds} "
                         f"(max(1, grad_accum // pp)), got {num_microbatches}")
    return num_microbatches // rounds


def warmup_forwards(rank: int, pp: int, num_local_stages: int, num_microbatches: int, extra: int = 0) -> int:
    """Forwards pipeline rank `rank` runs before its first backward: torch's count + `extra`, at most m * v."""
    per_round = microbatches_per_round(pp, num_microbatches)
    base = _get_warmup_ops(rank, num_local_stages, per_round, pp, num_microbatches, multiply_factor=2)
    return min(base + extra, num_microbatches * num_local_stages)


def rank_actions(rank: int, pp: int, num_local_stages: int, num_microbatches: int,
                 extra: int = 0) -> list[_Action | None]:
    """Compute-only action list (F and full B, None for idle slots) of pipeline rank `rank`, stages in loop
    placement (rank r holds stages r, r + pp, ...); with extra = 0 it is torch's interleaved 1F1B list."""
    v, m = num_local_stages, num_microbatches
    per_round = microbatches_per_round(pp, m)
    warmup = warmup_forwards(rank, pp, v, m, extra)
    steady = m * v - warmup  # 1F1B pairs; the cool-down runs the `warmup` backwards left

    def forward_stage(op: int) -> int:  # forwards walk the local stages in blocks of per_round micro-batches
        return (op // per_round) % v * pp + rank

    def backward_stage(op: int) -> int:  # backwards walk them in reverse, starting with the first backward
        return (v - 1 - (op - warmup) // per_round % v) * pp + rank

    return _get_1f1b_rank_ops(v, pp, warmup, steady, warmup, rank, forward_stage, backward_stage)


def all_rank_actions(pp: int, num_local_stages: int, num_microbatches: int,
                     extra: int = 0) -> dict[int, list[_Action | None]]:
    """rank_actions of every pipeline rank (the `pipeline_order` torch's runtime lowers and validates)."""
    return {r: rank_actions(r, pp, num_local_stages, num_microbatches, extra) for r in range(pp)}


def peak_held(actions: list[_Action | None], weight: Callable[[int], float] = lambda stage: 1.0) -> float:
    """The largest sum of weight(stage) over the stage-micro-batches a rank holds for backward (forward run,
    backward not yet) at any point of its action list; weight 1 counts them."""
    held: set[tuple[int, int]] = set()
    peak = total = 0.0
    for action in actions:
        if action is None:
            continue
        key = (action.stage_index, action.microbatch_index)
        if action.computation_type == _ComputationType.FORWARD:
            held.add(key)
            total += weight(action.stage_index)
            peak = max(peak, total)
        elif key in held:  # a full backward frees what its forward saved
            held.discard(key)
            total -= weight(action.stage_index)
    return peak


class ScheduleInterleaved1F1BExtraWarmup(ScheduleInterleaved1F1B):
    """torch's interleaved 1F1B whose ranks each run `extra_warmup` more warm-up forwards (capped by m * v)."""

    def __init__(self, stages, n_microbatches: int, *, extra_warmup: int = 0, **kwargs) -> None:
        if extra_warmup < 0:
            raise ValueError(f"extra_warmup must be at least 0, got {extra_warmup}")
        # Read by _calculate_single_rank_operations, which torch's __init__ calls for every rank.
        self.extra_warmup = extra_warmup
        super().__init__(stages, n_microbatches, **kwargs)

    def _calculate_single_rank_operations(self, rank: int) -> list[_Action | None]:
        return rank_actions(rank, self.pp_group_size, self.n_local_stages, self._n_microbatches, self.extra_warmup)
