"""Interleaved 1F1B with extra warm-up micro-batches (parallel.pp_extra_warmup, K2 report section 2.4).

Schedules: the per-rank action lists pass torch's own checks (`_validate_schedule`: every stage runs each
micro-batch's forward before its backward, once each; `_add_send_recv`: the p2p lowering finds a sender for every
receive; `_simulate_comms_compute`: the lowered lists progress to the end) over 2-4 ranks, 1-3 stages per rank,
2-12 micro-batches and 1, 2 or 5 extra forwards (with 0 the lists equal torch's own), and each rank really runs
`extra` more forwards before its first backward. Training: pp2 x 2 virtual stages over 4 micro-batches, QK-Clip
firing and the sequence-wise aux loss on, gives bit-identical losses and weights with extra 0, 1 and 2 (each
stage still runs its micro-batches' forwards and backwards in order 0..3, so every sum is taken in the same
order; measured: 0 difference).
"""

from __future__ import annotations

import contextlib
import io
import itertools
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining import ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _ComputationType,
    _simulate_comms_compute,
    _validate_schedule,
)

from openk2.train.config import RunConfig, load_run_config
from openk2.train.parallel.config import ParallelConfig
from openk2.train.parallel.plan import in_flight_microbatches, plan
from openk2.train.parallel.warmup_schedule import all_rank_actions, peak_held, rank_actions, warmup_forwards
from tests.train.parallel.ranks import run_ranks
from tests.train.parallel.runs import final_weights, micro_run, records

F, B = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
LAYOUTS = [(pp, v, m) for pp, v, m in itertools.product((2, 3, 4), (1, 2, 3), (2, 3, 4, 6, 8, 12))
           if m >= pp and m % max(1, m // pp) == 0]  # the micro-batch counts torch's interleaved 1F1B accepts


def _leading_forwards(actions: list) -> int:
    """Forwards before the first backward in an action list (None slots skipped)."""
    kinds = [a.computation_type for a in actions if a is not None]
    return kinds.index(B) if B in kinds else len(kinds)


def _lower_and_simulate(actions: dict[int, list], pp: int, num_stages: int, m: int) -> None:
    """torch's validation, p2p lowering and dry-run simulation (raises on a malformed or stuck schedule)."""
    _validate_schedule(actions, pp, num_stages, m)
    comms = _add_send_recv({r: list(a) for r, a in actions.items()}, lambda s: s % pp, num_stages)
    with contextlib.redirect_stdout(io.StringIO()):  # the simulator prints the stuck schedule before raising
        _simulate_comms_compute(comms, lambda s: s % pp, num_stages)


@pytest.mark.parametrize(("pp", "v", "m"), LAYOUTS)
def test_extra_zero_is_torchs_own_interleaved_list(pp, v, m):
    for rank in range(pp):
        torch_self = SimpleNamespace(n_local_stages=v, pp_group_size=pp, _n_microbatches=m,
                                     microbatches_per_round=m // max(1, m // pp))
        assert rank_actions(rank, pp, v, m) == ScheduleInterleaved1F1B._calculate_single_rank_operations(
            torch_self, rank)


@pytest.mark.parametrize(("pp", "v", "m"), LAYOUTS)
@pytest.mark.parametrize("extra", [1, 2, 5])
def test_extra_warmup_schedules_are_valid_and_warm_up_longer(pp, v, m, extra):
    actions = all_rank_actions(pp, v, m, extra)
    _lower_and_simulate(actions, pp, pp * v, m)
    base = all_rank_actions(pp, v, m)
    for rank in range(pp):
        warmup = warmup_forwards(rank, pp, v, m, extra)
        assert warmup == min(warmup_forwards(rank, pp, v, m) + extra, m * v)
        # The steady state opens with a forward, so one more than the warm-up precede the first backward.
        assert _leading_forwards(actions[rank]) == min(warmup + 1, m * v) == peak_held(actions[rank])
        assert _leading_forwards(actions[rank]) - _leading_forwards(base[rank]) == min(
            extra, m * v - _leading_forwards(base[rank]))  # capped by the forwards there are


def test_the_simulation_catches_a_deadlocked_order():
    """The checks above can fail: rank 1 takes micro-batch 1 first while rank 0 waits on micro-batch 0's backward."""
    order = {0: [_Action(0, F, 0), _Action(0, B, 0), _Action(0, F, 1), _Action(0, B, 1)],
             1: [_Action(1, F, 1), _Action(1, B, 1), _Action(1, F, 0), _Action(1, B, 0)]}
    _validate_schedule(order, 2, 2, 2)  # each stage's set of actions is complete: only the order is wrong
    with pytest.raises(AssertionError, match="can't schedule"):
        _lower_and_simulate(order, 2, 2, 2)


def test_the_config_field_is_checked():
    assert ParallelConfig(pp=2, pp_virtual_stages=2, pp_extra_warmup=2).pp_extra_warmup == 2
    with pytest.raises(ValueError, match="pp_extra_warmup must be at least 0"):
        ParallelConfig(pp=2, pp_virtual_stages=2, pp_extra_warmup=-1)
    for schedule, v in (("1f1b", 1), ("gpipe", 1), ("zbv_zero_bubble", 2), ("interleaved_zero_bubble", 2)):
        with pytest.raises(ValueError, match="interleaved_1f1b only"):
            ParallelConfig(pp=2, pp_virtual_stages=v, pp_schedule=schedule, pp_extra_warmup=1)
    with pytest.warns(UserWarning, match="is ignored"):
        ParallelConfig(pp=1, pp_extra_warmup=1)


def test_plan_counts_the_extra_in_flight_micro_batches():
    """Each extra warm-up forward keeps one more stage-micro-batch on every rank: the planned activations grow by
    one stage's activations per extra (and on the last rank by its logits too, while the last stage is warmed)."""
    overrides = ["parallel.pp=2", "parallel.pp_virtual_stages=2", "train.grad_accum=4", "model.num_hidden_layers=4"]
    rows = {e: plan(load_run_config("configs/tiny.toml", [*overrides, f"parallel.pp_extra_warmup={e}"]),
                    device_type="cpu")["per_rank"] for e in (0, 1, 2)}
    cfg = load_run_config("configs/tiny.toml", overrides)
    assert [in_flight_microbatches(cfg.parallel, r, 4) for r in (0, 1)] == [5, 3]  # torch's warm-up + 1
    extra2 = ParallelConfig(pp=2, pp_virtual_stages=2, pp_extra_warmup=2)
    assert [in_flight_microbatches(extra2, r, 4) for r in (0, 1)] == [7, 5]
    from openk2.train.parallel.build import meta_model_part
    from openk2.train.parallel.mesh import ParallelMesh
    from openk2.train.parallel.plan import activation_model, rope_table_bytes

    part, _ = meta_model_part(cfg.model, ParallelMesh(cfg.parallel, None, 0, 0, 0, 0))
    act = activation_model(cfg, cfg.parallel, part, "cpu")  # the plan's own counts (fp32 on CPU: fused kernel)
    tokens = cfg.train.batch_size * cfg.data.seq_len
    # one layer per stage, and the stage-micro-batch's own RoPE tables
    stage = tokens * (max(act.layer(cfg.model.is_moe_layer(i)) for i in range(4)) + rope_table_bytes(cfg.model))
    head = tokens * act.head()
    # Rank 0 (stages 0, 2) holds e more stage-micro-batches. Rank 1 (stages 1, 3; 3 is the last) forwards
    # 1:0 1:1 | 3:0 3:1 | 1:2 ...; at its peak it holds, with e = 0: 1:0 1:1 3:0 (one with logits); e = 1:
    # 1:0 1:1 3:0 3:1 (two); e = 2: 1:0 1:1 3:0 3:1 1:2 (still two: a round has 2 micro-batches per stage).
    want = {1: (stage, stage + head), 2: (2 * stage, 2 * stage + head)}
    for e in (1, 2):
        grown = [rows[e][r]["activation_bytes"] - rows[0][r]["activation_bytes"] for r in (0, 1)]
        assert grown == pytest.approx(want[e], abs=2)
        assert rows[e][0]["total_bytes"] - rows[0][0]["total_bytes"] == pytest.approx(want[e][0], abs=2)


# ------------------------------------------------------------------------------------------ real gloo runs
STEPS = 3
MESH = {"pp": 2, "pp_virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}
EXTRAS = (0, 1, 2)


def _train_all(rank: int, raws: list[dict]) -> list[list[tuple[str, int, int]]]:
    """Each run in turn on this rank; returns the executed (kind, stage, micro-batch) order of each run's first step."""
    import openk2.train.trainer
    from openk2.train.parallel.trainer import ParallelTrainer

    openk2.train.trainer.plot_run = lambda run_dir: []  # plots are not under test and cost seconds
    executed = []
    for raw in raws:
        trainer = ParallelTrainer(RunConfig.from_dict(raw))
        log: list[tuple[str, int, int]] = []
        for stage in trainer.pipeline._stages:
            _record(stage, "forward_one_chunk", "F", log)
            _record(stage, "backward_one_chunk", "B", log)
        trainer.run()
        per_step = len(log) // STEPS
        executed.append(log[:per_step])
    return executed


def _record(stage, method: str, kind: str, log: list) -> None:
    inner = getattr(stage, method)

    def wrapped(chunk_id, *args, **kwargs):
        log.append((kind, stage.stage_index, chunk_id))
        return inner(chunk_id, *args, **kwargs)

    setattr(stage, method, wrapped)


@pytest.mark.slow
def test_pp2_extra_warmup_trains_exactly_as_without(tmp_path, micro_tokenizer_dir):
    raws = []
    for e in EXTRAS:
        raw = micro_run(micro_tokenizer_dir, tmp_path / f"extra{e}", {**MESH, "pp_extra_warmup": e}, 1, 4, STEPS)
        raw["model"]["aux_loss_alpha"] = 0.05  # moves the loss by ~1e-1: the aux path is exercised
        raws.append(raw)
    executed = run_ranks(2, _train_all, raws)
    for rank in (0, 1):
        base = executed[rank][0]
        for e, order in zip(EXTRAS, executed[rank], strict=True):
            assert sorted(order) == sorted(base)  # the same 2 stages x 4 micro-batches, forward and backward
            warm = [k for k, _, _ in order].index("B")  # the warm-up and the steady state's first forward
            assert warm - 1 == warmup_forwards(rank, 2, 2, 4, e) == (4 if rank == 0 else 2) + e  # torch's + e
            for s in {s for _, s, _ in order}:  # each stage keeps micro-batch order 0..3 in both directions
                for kind in "FB":
                    assert [mb for k, st, mb in order if k == kind and st == s] == [0, 1, 2, 3]
    want, want_weights = records(tmp_path / "extra0"), final_weights(tmp_path / "extra0", STEPS)
    assert all(want[s]["clipped_heads"] > 0 for s in want)  # QK-Clip fires every step
    for e in EXTRAS[1:]:
        got = records(tmp_path / f"extra{e}")
        assert [got[s]["loss"] for s in sorted(got)] == [want[s]["loss"] for s in sorted(want)]
        assert [got[s]["clipped_heads"] for s in sorted(got)] == [want[s]["clipped_heads"] for s in sorted(want)]
        assert got[STEPS]["val_loss"] == want[STEPS]["val_loss"]
        weights = final_weights(tmp_path / f"extra{e}", STEPS)
        assert weights.keys() == want_weights.keys()
        for name, value in want_weights.items():
            assert torch.equal(weights[name], value), name
