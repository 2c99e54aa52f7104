"""Parallel pre-training on real gloo processes matches the single-process run of the same global batch.

Reference: one process, batch_size 4, grad_accum 1. The parallel runs split the same 4 rows: dp=2 and ep=2
give each rank 2 rows; dp=2 x ep=2 (4 ranks, launched through torchrun and the CLI) one row; pp=2 with 2
virtual stages (interleaved 1F1B) runs 2 micro-batches of 2 rows. Each rank's loss is its token-summed
cross-entropy over the step's global target count, and gradients are summed over ranks and micro-batches,
so the parallel gradient is the single-process gradient up to fp32 summation order. QK-Clip is on at
tau = 0.04, so heads are clipped on every step, from max logits MAX-reduced over ranks. Tolerance: per-step
losses rel 1e-5, parameters abs 1e-5 after 4 steps (measured: ~1e-7).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomli_w
import torch

from openk2.train.checkpoint import CheckpointManager
from openk2.train.config import RunConfig
from openk2.train.hf_export import read_model_state
from openk2.train.metrics import read_metrics
from openk2.train.trainer import Trainer
from tests.train.parallel.ranks import run_ranks

STEPS = 4
GLOBAL_BATCH = 4
AUX = 0.05  # sequence-wise aux loss weight of the aux runs: large enough to move the losses by ~1e-1


def _raw(micro_raw: dict, out_dir: Path, parallel: dict | None = None, grad_accum: int = 1,
         checkpoint_every: int = STEPS, aux_loss_alpha: float = 0.0) -> dict:
    raw = copy.deepcopy(micro_raw)
    raw["out_dir"] = str(out_dir)
    raw["model"]["num_hidden_layers"] = 4  # 1 dense + 3 MoE layers: enough for 4 pipeline stages
    raw["model"]["aux_loss_alpha"] = aux_loss_alpha
    raw["optim"].update(qk_clip_tau=0.04)  # below the ~0.05-0.08 max logits of this run: clips every step
    ranks = (parallel or {}).get("dp", 1) * (parallel or {}).get("ep", 1)
    raw["train"].update(steps=STEPS, precision="fp32", batch_size=GLOBAL_BATCH // ranks // grad_accum,
                        grad_accum=grad_accum, eval_every=STEPS, checkpoint_every=checkpoint_every,
                        eval_batches=grad_accum)  # validation batches hold batch_size rows: the same 4 rows
    raw["parallel"] = parallel or {}
    return raw


def _train(rank: int, raw: dict, max_steps: int | None, resume: bool) -> None:
    from openk2.train.parallel.trainer import ParallelTrainer

    ParallelTrainer(RunConfig.from_dict(raw), resume=resume).run(max_steps=max_steps)


def _run_all(rank: int, jobs: list[tuple[dict, int | None, bool]]) -> None:
    import openk2.train.trainer

    openk2.train.trainer.plot_run = lambda run_dir: []  # plots are not under test and cost seconds per run
    for raw, max_steps, resume in jobs:  # several layouts in one set of processes: start-up is the slow part
        _train(rank, raw, max_steps, resume)


def _weights(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    path = CheckpointManager(run_dir / "checkpoints").path_for(step)
    return read_model_state(path)  # from the DCP shards (parallel checkpoints hold no safetensors)


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def _assert_same_run(run_dir: Path, reference: Path) -> None:
    got, want = _records(run_dir), _records(reference)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), f"step {step}"
        assert got[step]["clipped_heads"] == want[step]["clipped_heads"] > 0
        np.testing.assert_allclose(got[step]["expert_load"], want[step]["expert_load"], rtol=0, atol=1e-7)
    assert got[STEPS]["val_loss"] == pytest.approx(want[STEPS]["val_loss"], rel=1e-5)
    weights, expected = _weights(run_dir), _weights(reference)
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, micro_tokenizer_dir) -> dict[str, Path]:
    """The single-process reference and the two-rank runs (dp=2, ep=2, two pp=2 x 2 virtual schedules, resume)."""
    root = tmp_path_factory.mktemp("parallel")
    from tests.train.conftest import MICRO_DATA, MICRO_MODEL

    micro_raw = {
        "model": dict(MICRO_MODEL), "tokenizer": {"path": str(micro_tokenizer_dir)}, "data": copy.deepcopy(MICRO_DATA),
        "optim": {"lr": 1e-2, "ns_dtype": "float32"}, "schedule": {"warmup_steps": 2, "decay_fraction": 0.25},
        "train": {"log_every": 1, "keep_checkpoints": 5, "threads": 1},
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("openk2.train.trainer.plot_run", lambda run_dir: [])
        Trainer(RunConfig.from_dict(_raw(micro_raw, root / "single"))).run()
        Trainer(RunConfig.from_dict(_raw(micro_raw, root / "single-aux", aux_loss_alpha=AUX))).run()
    layouts = {
        "dp2": ({"dp": 2}, 1),
        "ep2": ({"ep": 2}, 1),
        "pp2": ({"pp": 2, "pp_virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}, 2),
        "pp2-zbv": ({"pp": 2, "pp_virtual_stages": 2, "pp_schedule": "zbv_zero_bubble"}, 2),
    }
    jobs = [(_raw(micro_raw, root / name, parallel, accum), None, False) for name, (parallel, accum) in layouts.items()]
    aux_layouts = {"pp2-aux": (layouts["pp2"][0], 2), "pp2-zbv-aux": (layouts["pp2-zbv"][0], 2),
                   "dp2-aux": ({"dp": 2}, 1)}
    jobs += [(_raw(micro_raw, root / name, parallel, accum, aux_loss_alpha=AUX), None, False)
             for name, (parallel, accum) in aux_layouts.items()]
    resumed = _raw(micro_raw, root / "dp2-resumed", {"dp": 2}, checkpoint_every=2)
    jobs += [(resumed, 2, False), (resumed, None, True)]
    run_ranks(2, _run_all, jobs)
    out = {name: root / name for name in (*layouts, *aux_layouts, "single", "single-aux", "dp2-resumed")}
    out["micro_raw"] = micro_raw
    out["root"] = root
    return out


@pytest.mark.slow
def test_zero1_data_parallel_matches_single_process(runs):
    _assert_same_run(runs["dp2"], runs["single"])
    saved = CheckpointManager(runs["dp2"] / "checkpoints").path_for(STEPS)
    assert {p.name.split("_")[2] for p in (saved / "dcp").glob("*.distcp")} == {"0", "1"}  # each rank wrote shards
    assert sorted(p.name for p in (saved / "ranks").iterdir()) == ["rank-00000.pt", "rank-00001.pt"]


@pytest.mark.slow
def test_expert_parallel_matches_single_process(runs):
    _assert_same_run(runs["ep2"], runs["single"])


@pytest.mark.slow
def test_interleaved_pipeline_with_virtual_stages_matches_single_process(runs):
    _assert_same_run(runs["pp2"], runs["single"])


@pytest.mark.slow
def test_zero_bubble_v_schedule_matches_single_process(runs):
    """Weight gradients split from input gradients (the report's PP overlap), stages in V placement."""
    _assert_same_run(runs["pp2-zbv"], runs["single"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2-aux", "pp2-zbv-aux", "dp2-aux"])
def test_sequence_wise_aux_loss_matches_single_process(runs, layout):
    """The aux loss of every stage reaches the objective (its gradient rides the stage's output gradient)."""
    _assert_same_run(runs[layout], runs["single-aux"])
    with_aux, without = _records(runs["single-aux"]), _records(runs["single"])
    assert with_aux[1]["loss"] - without[1]["loss"] > 0.01  # the aux term is really there (same weights)


@pytest.mark.slow
def test_dp2_checkpoint_resumes_identically(runs):
    resumed, straight = _records(runs["dp2-resumed"]), _records(runs["dp2"])
    assert [resumed[s]["loss"] for s in range(1, STEPS + 1)] == [straight[s]["loss"] for s in range(1, STEPS + 1)]
    weights = _weights(runs["dp2-resumed"])
    for name, value in _weights(runs["dp2"]).items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_dp2_times_ep2_under_torchrun_matches_single_process(runs):
    """The CLI path: `torchrun --nproc-per-node 4 -m openk2 pretrain --config ...` on 4 ranks (2 dp x 2 ep)."""
    raw = _raw(runs["micro_raw"], runs["root"] / "dp2ep2", {"dp": 2, "ep": 2})
    config = runs["root"] / "dp2ep2.toml"
    config.write_text(tomli_w.dumps(raw))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "openk2", "pretrain", "--config", str(config)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("run directory") == 1  # rank 0 reports for the job
    _assert_same_run(runs["root"] / "dp2ep2", runs["single"])
