"""FSDP2 with expert parallelism (`shard = "fsdp2"`, dp = 2 x ep = 2) on 4 real gloo ranks equals one process.

Layout (fsdp.py): each ep rank's 4 of the 8 routed experts are one FSDP2 unit sharded over "dp" (2 experts per
rank), every dense tensor is sharded over "data" = dp x ep (a quarter per rank). Reference: one process,
batch 4; the 4 data ranks read 1 row each, the same rows. The micro model (4 layers, 3 MoE) with QK-Clip at
tau 0.04 clips heads on every step, from max logits MAX-reduced over all 4 ranks. Checked: losses (rel 1e-5),
clipped heads, the final validation loss and the weights gathered from the DCP shards (abs 1e-5, the
tolerance of test_fsdp.py; measured: printed); the step-2 checkpoint (each rank writes its expert and dense
rows under the single-process names) resumed by one process and by ZeRO-1 at dp2 x ep2, and the reference's
step-2 checkpoint resumed under fsdp2 x ep2, continue the reference run; per-rank state bytes after a real
backward equal `openk2 plan`'s prediction and a quarter of one process's; each matrix is orthogonalised once.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from openk2.train.checkpoint import CheckpointManager
from openk2.train.config import RunConfig
from openk2.train.parallel.plan import plan
from openk2.train.trainer import Trainer
from tests.train.conftest import MICRO_MODEL
from tests.train.parallel.runs import assert_same_run, micro_run, records

STEPS = 4
GLOBAL_BATCH = 4
FSDP_EP = {"dp": 2, "ep": 2, "shard": "fsdp2"}
MODEL = {**MICRO_MODEL, "num_hidden_layers": 4}


def _raw(tokenizer_dir, out_dir, parallel: dict, optimizer: str = "muon") -> dict:
    data_ranks = parallel.get("dp", 1) * parallel.get("ep", 1)
    raw = micro_run(tokenizer_dir, out_dir, parallel, GLOBAL_BATCH // data_ranks, 1, STEPS)
    raw["train"]["checkpoint_every"] = 2
    raw["optim"]["optimizer"] = optimizer
    return raw


def _seed_from(source: Path, target: Path, step: int) -> None:
    """`target` becomes a copy of run `source` as it was after `step` (later checkpoints removed)."""
    shutil.copytree(source, target)
    manager = CheckpointManager(target / "checkpoints")
    for later in range(step + 1, STEPS + 1):
        if manager.path_for(later).exists():
            shutil.rmtree(manager.path_for(later))


def _jobs(rank: int, jobs: list[tuple[dict, bool, tuple | None]]) -> dict:
    """Each (raw config, resume, seed) run on every rank, then this rank's held state bytes under fsdp2 x ep2
    and the matrices it orthogonalises in one step (test_fsdp_memory's probe)."""
    import openk2.train.trainer
    from openk2.train.parallel.trainer import ParallelTrainer
    from tests.train.parallel.test_fsdp_memory import _measure_and_count

    openk2.train.trainer.plot_run = lambda run_dir: []  # plots are not under test and cost seconds per run
    for raw, resume, seed in jobs:
        if seed is not None:
            if rank == 0:
                _seed_from(*seed)
            dist.barrier()
        ParallelTrainer(RunConfig.from_dict(raw), resume=resume).run()
    return _measure_and_count(rank, FSDP_EP)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, micro_tokenizer_dir) -> dict:
    from tests.train.parallel.ranks import run_ranks

    root = tmp_path_factory.mktemp("fsdp-ep")
    tok = micro_tokenizer_dir
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("openk2.train.trainer.plot_run", lambda run_dir: [])
        Trainer(RunConfig.from_dict(_raw(tok, root / "single", {}))).run()
        Trainer(RunConfig.from_dict(_raw(tok, root / "single-adamw", {}, "adamw"))).run()
    jobs = [(_raw(tok, root / "fsdp2-ep2", FSDP_EP), False, None),
            (_raw(tok, root / "fsdp2-ep2-adamw", FSDP_EP, "adamw"), False, None),
            (_raw(tok, root / "zero1-ep2-from-fsdp2", {"dp": 2, "ep": 2}), True,
             (root / "fsdp2-ep2", root / "zero1-ep2-from-fsdp2", 2)),
            (_raw(tok, root / "fsdp2-ep2-from-single", FSDP_EP), True,
             (root / "single", root / "fsdp2-ep2-from-single", 2))]
    held = run_ranks(4, _jobs, jobs)
    _seed_from(root / "fsdp2-ep2", root / "single-from-fsdp2-ep2", 2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("openk2.train.trainer.plot_run", lambda run_dir: [])
        Trainer(RunConfig.from_dict(_raw(tok, root / "single-from-fsdp2-ep2", {})), resume=True).run()
    return {"probe": held, **{p.name: p for p in root.iterdir() if p.is_dir()}}


@pytest.mark.slow
def test_fsdp2_ep2_matches_single_process(runs):
    diff = assert_same_run(runs["fsdp2-ep2"], runs["single"], STEPS)
    got, want = records(runs["fsdp2-ep2"]), records(runs["single"])
    rel = max(abs(got[s]["loss"] / want[s]["loss"] - 1) for s in want)
    saved = CheckpointManager(runs["fsdp2-ep2"] / "checkpoints").path_for(STEPS)
    assert {p.name.split("_")[2] for p in (saved / "dcp").glob("*.distcp")} == {"0", "1", "2", "3"}  # all wrote
    print(f"fsdp2 dp2 x ep2: largest weight difference after {STEPS} steps {diff:.2e}, loss rel {rel:.1e}, "
          f"clipped heads {[got[s]['clipped_heads'] for s in sorted(got)]}")


@pytest.mark.slow
def test_fsdp2_ep2_with_adamw_only_matches_single_process(runs):
    """The AdamW-only optimizer: the expert stacks' moments are DTensor shards over "dp", the dense ones over
    dp x ep, stepped by one torch.optim.AdamW."""
    diff = assert_same_run(runs["fsdp2-ep2-adamw"], runs["single-adamw"], STEPS)
    print(f"fsdp2 dp2 x ep2 adamw: largest weight difference after {STEPS} steps {diff:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single-from-fsdp2-ep2", "zero1-ep2-from-fsdp2", "fsdp2-ep2-from-single"])
def test_fsdp2_ep2_checkpoint_resumes_at_other_layouts(runs, layout):
    """The fsdp2 x ep2 step-2 checkpoint resumed by one process and by ZeRO-1 at dp2 x ep2, and the one-process
    step-2 checkpoint resumed under fsdp2 x ep2 (each rank loading its expert and dense rows): steps 3-4 follow."""
    assert_same_run(runs[layout], runs["single"], STEPS)


@pytest.mark.slow
def test_fsdp2_ep2_states_per_rank_equal_the_plan(runs):
    """Parameters and gradients (FSDP2 pads every storage to rank 0's rows) equal the plan on every rank; the
    optimizer state covers the unpadded rows, so the plan (rank 0's) bounds it and equals rank 0's."""
    planned = plan(RunConfig.from_dict({"model": dict(MODEL), "parallel": FSDP_EP}), device_type="cpu")
    held = {rank: probe["held"] for rank, probe in runs["probe"].items()}
    for row in planned["per_rank"]:
        got = held[row["rank"]]
        assert got["params"] == row["params_bytes"], row["rank"]
        assert got["grads"] == row["grads_bytes"], row["rank"]
        assert got["master"] == row["master_bytes"] == 0
        assert got["optimizer"] <= row["optimizer_bytes"]
    assert held[0]["optimizer"] == planned["per_rank"][0]["optimizer_bytes"]
    single = plan(RunConfig.from_dict({"model": dict(MODEL)}), device_type="cpu")["per_rank"][0]
    # 8 experts: 4 per ep rank, 2 per dp shard; every dense tensor's rows divide by 4: exactly a quarter
    assert all(4 * h["params"] == 4 * h["grads"] == single["params_bytes"] for h in held.values())
    assert all(probe["bytes"] == probe["held"] for probe in runs["probe"].values())  # the step keeps no more
    print("fsdp2 dp2 x ep2 bytes per rank (params, grads, optimizer):",
          [(held[r]["params"], held[r]["grads"], held[r]["optimizer"]) for r in sorted(held)],
          "plan:", [(r["params_bytes"], r["grads_bytes"], r["optimizer_bytes"]) for r in planned["per_rank"]],
          "one process params:", single["params_bytes"])


@pytest.mark.slow
def test_fsdp2_ep2_orthogonalises_each_matrix_once(runs):
    """Over the 4 ranks, one step orthogonalises what one process does: each expert by the one rank holding it
    (its ep rank's slice, its dp shard), each dense 2-D matrix by its one owner in dp x ep."""
    from tests.train.parallel.test_fsdp_memory import _muon_matrices

    counts = {rank: probe["orthogonalised"] for rank, probe in runs["probe"].items()}
    assert sum(counts.values()) == _muon_matrices(), counts
    assert all(counts.values()), counts  # every rank holds experts and owns dense matrices


def test_fsdp2_plan_splits_dense_over_dp_times_ep_and_experts_over_dp():
    """The plan's fsdp2 shares with ep: dense rows over dp x ep, this ep rank's experts over dp; for the micro
    model (every count divides) dp2 x ep2 is dp = 4's share and dp1 x ep2 is dp = 2's, and ep alone shards."""
    def rank0(parallel: dict) -> dict:
        return plan(RunConfig.from_dict({"model": dict(MODEL), "parallel": parallel}), device_type="cpu")["per_rank"][0]
    keys = ("params_bytes", "grads_bytes", "optimizer_bytes")
    dp4, dp2 = rank0({"dp": 4, "shard": "fsdp2"}), rank0({"dp": 2, "shard": "fsdp2"})
    assert [rank0(FSDP_EP)[k] for k in keys] == [dp4[k] for k in keys]
    assert [rank0({"ep": 2, "shard": "fsdp2"})[k] for k in keys] == [dp2[k] for k in keys]
    zero1 = rank0({"dp": 2, "ep": 2})
    assert rank0(FSDP_EP)["params_bytes"] < zero1["params_bytes"] / 2  # ZeRO-1 replicates dense over dp x ep
