"""FSDP2 with pipeline stages (`shard = "fsdp2"`, pp = 2) on 4 real gloo ranks equals one process.

Two layouts of 4 processes in one spawn: pp2 x dp2 and pp2 x ep2, each with 2 stages per pipeline rank
(interleaved 1F1B over 2 micro-batches, 1 layer per stage of the 4-layer micro MoE). Every stage module is an
FSDP2 root over the dense mesh ("dp", or "data" = dp x ep), its decoder layers units inside it and (ep) its
experts' slices units over "dp"; torch's PipelineStage accumulates the unsharded gradients over the
micro-batches and reduce-scatters them after the stage's last backward. 2 data ranks x 1 row x 2
micro-batches = the single-process batch of 4 rows; QK-Clip at tau 0.04 clips heads on every step from max
logits MAX-reduced over all 4 ranks (each pipeline rank fills its own layers' rows). Tolerances as
test_fsdp.py: losses rel 1e-5, weights gathered from the DCP shards abs 1e-5 (measured: printed). The
pp2 x ep2 run's step-2 checkpoint (stage-local tensors saved under the single-process names) resumed by one
process continues the single-process run.
"""

from __future__ import annotations

import shutil

import pytest

from openk2.train.checkpoint import CheckpointManager
from openk2.train.config import RunConfig
from openk2.train.trainer import Trainer
from tests.train.parallel.runs import assert_same_run, micro_run

STEPS = 3
PIPELINE = {"pp": 2, "pp_virtual_stages": 2, "pp_schedule": "interleaved_1f1b", "shard": "fsdp2"}
LAYOUTS = {"fsdp2-pp2-dp2": {**PIPELINE, "dp": 2}, "fsdp2-pp2-ep2": {**PIPELINE, "ep": 2, "ep_overlap": False}}


def _train(rank: int, raws: list[dict]) -> None:
    import openk2.train.trainer
    from openk2.train.parallel.trainer import ParallelTrainer

    openk2.train.trainer.plot_run = lambda run_dir: []  # plots are not under test and cost seconds per run
    for raw in raws:
        ParallelTrainer(RunConfig.from_dict(raw)).run()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, micro_tokenizer_dir) -> dict:
    from tests.train.parallel.ranks import run_ranks

    root = tmp_path_factory.mktemp("fsdp-pp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("openk2.train.trainer.plot_run", lambda run_dir: [])
        Trainer(RunConfig.from_dict(micro_run(micro_tokenizer_dir, root / "single", {}, 4, 1, STEPS))).run()
    raws = [micro_run(micro_tokenizer_dir, root / name, layout, 1, 2, STEPS) for name, layout in LAYOUTS.items()]
    for raw in raws:
        raw["train"]["checkpoint_every"] = 2
    run_ranks(4, _train, raws)
    shutil.copytree(root / "fsdp2-pp2-ep2", root / "single-from-fsdp2-pp2-ep2")
    shutil.rmtree(CheckpointManager(root / "single-from-fsdp2-pp2-ep2" / "checkpoints").path_for(STEPS))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("openk2.train.trainer.plot_run", lambda run_dir: [])
        raw = micro_run(micro_tokenizer_dir, root / "single-from-fsdp2-pp2-ep2", {}, 4, 1, STEPS)
        Trainer(RunConfig.from_dict(raw), resume=True).run()
    return {p.name: p for p in root.iterdir() if p.is_dir()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fsdp2_with_pipeline_stages_matches_single_process(runs, layout):
    diff = assert_same_run(runs[layout], runs["single"], STEPS)
    print(f"{layout}: largest weight difference after {STEPS} steps {diff:.2e}")


@pytest.mark.slow
def test_fsdp2_pp2_ep2_checkpoint_resumes_at_one_process(runs):
    assert_same_run(runs["single-from-fsdp2-pp2-ep2"], runs["single"], STEPS)
