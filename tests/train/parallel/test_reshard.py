"""DCP checkpoints resume at another layout and continue the same loss curve (real gloo processes).

Reference: one process, 5 steps of the micro model (4 layers, QK-Clip at tau = 0.04 so heads are clipped every
step), checkpoints at steps 2 and 4. Two resharded resumes, each >= 3 steps past the checkpoint:
- dp2 x ep2 (4 ranks, ZeRO-1 slices of dense and expert weights, experts split; saved asynchronously) to step
  2, resumed by the single-process Trainer for steps 3-5;
- the reference's own step-2 checkpoint, resumed at pp2 (2 ranks, 2 virtual stages, interleaved 1F1B) for steps
  3-5.
Parallel and single-process runs of this model differ only by fp32 summation order: per-step losses agree to
rel 1e-5. Weights are compared at abs 3e-5: measured max 1.1e-5 after 5 steps, in embedding rows, where AdamW's
m / sqrt(v) amplifies the summation-order noise of tiny gradients (1.7e-6 already at step 2, before any
resume; the optimizer states themselves agree to 7e-8 there); every other tensor agrees to 3e-7.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch

from openk2.model import K2ForCausalLM
from openk2.train.checkpoint import CheckpointManager
from openk2.train.config import RunConfig
from openk2.train.hf_export import export_hf, read_model_state
from openk2.train.metrics import read_metrics
from openk2.train.trainer import Trainer
from tests.train.parallel.ranks import run_ranks

STEPS, SAVED_AT = 5, 2


def _raw(tokenizer_dir: Path, out_dir: Path, parallel: dict | None = None, grad_accum: int = 1,
         async_checkpoint: bool = False) -> dict:
    from tests.train.conftest import MICRO_DATA, MICRO_MODEL

    ranks = (parallel or {}).get("dp", 1) * (parallel or {}).get("ep", 1)
    return {
        "out_dir": str(out_dir), "model": {**MICRO_MODEL, "num_hidden_layers": 4},
        "tokenizer": {"path": str(tokenizer_dir)}, "data": copy.deepcopy(MICRO_DATA),
        "optim": {"lr": 1e-2, "ns_dtype": "float32", "qk_clip_tau": 0.04},
        "schedule": {"warmup_steps": 2, "decay_fraction": 0.25},
        "train": {"steps": STEPS, "batch_size": 4 // ranks // grad_accum, "grad_accum": grad_accum, "log_every": 1,
                  "eval_every": STEPS, "eval_batches": grad_accum, "checkpoint_every": SAVED_AT,
                  "keep_checkpoints": 5, "threads": 1, "precision": "fp32", "async_checkpoint": async_checkpoint},
        "parallel": parallel or {},
    }


def _train(rank: int, raw: dict, max_steps: int | None, resume: bool) -> None:
    import openk2.train.trainer
    from openk2.train.parallel.trainer import ParallelTrainer

    openk2.train.trainer.plot_run = lambda run_dir: []  # plots are not under test and cost seconds per run
    ParallelTrainer(RunConfig.from_dict(raw), resume=resume).run(max_steps=max_steps)


def _losses(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def _assert_continues(run_dir: Path, reference: Path) -> None:
    got, want = _losses(run_dir), _losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), f"step {step}"
        assert got[step]["clipped_heads"] == want[step]["clipped_heads"] > 0, f"step {step}"
    assert got[STEPS]["val_loss"] == pytest.approx(want[STEPS]["val_loss"], rel=1e-5)
    final = CheckpointManager(run_dir / "checkpoints").path_for(STEPS)
    weights, expected = read_model_state(final), read_model_state(CheckpointManager(reference / "checkpoints")
                                                                    .path_for(STEPS))
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=3e-5, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, micro_tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reshard")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("openk2.train.trainer.plot_run", lambda run_dir: [])
        Trainer(RunConfig.from_dict(_raw(micro_tokenizer_dir, root / "single"))).run()
        # Saved at dp2 x ep2 (asynchronously), resumed at one process.
        run_ranks(4, _train, _raw(micro_tokenizer_dir, root / "dp2ep2-to-1", {"dp": 2, "ep": 2},
                                  async_checkpoint=True), SAVED_AT, False)
        Trainer(RunConfig.from_dict(_raw(micro_tokenizer_dir, root / "dp2ep2-to-1")), resume=True).run()
    # Saved at one process (the reference's step-2 checkpoint), resumed at pp2.
    saved = CheckpointManager(root / "single" / "checkpoints").path_for(SAVED_AT)
    shutil.copytree(saved, root / "1-to-pp2" / "checkpoints" / saved.name)
    pp2 = {"pp": 2, "pp_virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}
    lines = [line for line in (root / "single" / "metrics.jsonl").read_text().splitlines()
             if '"step": 1,' in line or '"step": 2,' in line]
    (root / "1-to-pp2" / "metrics.jsonl").write_text("\n".join(lines) + "\n")  # the saving run's records
    run_ranks(2, _train, _raw(micro_tokenizer_dir, root / "1-to-pp2", pp2, grad_accum=2), None, True)
    return {"root": root, "single": root / "single", "dp2ep2-to-1": root / "dp2ep2-to-1", "1-to-pp2": root / "1-to-pp2"}


@pytest.mark.slow
def test_saved_at_dp2_ep2_resumes_at_one_process(runs):
    _assert_continues(runs["dp2ep2-to-1"], runs["single"])
    saved = CheckpointManager(runs["dp2ep2-to-1"] / "checkpoints").path_for(SAVED_AT)
    shards = sorted(p.name for p in (saved / "dcp").glob("*.distcp"))
    assert {name.split("_")[2] for name in shards} == {"0", "1", "2", "3"}  # every rank wrote its own shards
    assert not (saved / "model.safetensors").exists()  # nothing was gathered into one rank
    # The HF export streams the same weights out of the 4 ranks' shards (experts from two ranks' blocks).
    export_hf(saved, runs["root"] / "hf")
    exported = K2ForCausalLM.from_pretrained(runs["root"] / "hf", dtype=torch.float32).state_dict()
    for name, value in read_model_state(saved).items():
        assert torch.equal(exported[name], value), name


@pytest.mark.slow
def test_saved_at_one_process_resumes_at_pp2(runs):
    _assert_continues(runs["1-to-pp2"], runs["single"])
