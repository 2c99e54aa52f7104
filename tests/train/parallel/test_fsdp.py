"""FSDP2 (`parallel.shard = "fsdp2"`) on 2 real gloo ranks equals one process, and its checkpoints reshard.

Reference: one process, batch 4; fsdp2 at dp = 2 with batch 2 per rank reads the same rows. The micro model
(4 layers, 8 experts, fp32) with QK-Clip at tau 0.04 clips heads on every step. Weights, gradients and
optimizer state are DTensor shards; FSDP2 reduce-scatters the gradients (a different fp32 summation order
than one process), so losses are compared at rel 1e-5 and the final weights at abs 1e-5 (measured: see
docs/parallelism.md, "FSDP2"). Resume: a fsdp2 checkpoint at step 2 resumed under fsdp2 continues the same run
bit for bit, and resumed by one process or by ZeRO-1 at dp = 2 continues the reference run (and the reference's
step-2 checkpoint resumed under fsdp2 does too). With grad_accum = 2
(1 row per rank per micro-batch) fsdp2 equals the reference too, and with bf16 compute (param_dtype = bfloat16)
it follows a one-process ZeRO-1 bf16 run to bf16 tolerance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from openk2.train.checkpoint import CheckpointManager
from openk2.train.config import RunConfig
from openk2.train.trainer import Trainer
from tests.train.parallel.ranks import run_ranks
from tests.train.parallel.runs import assert_same_run, final_weights, micro_run, records

STEPS = 4
GLOBAL_BATCH = 4


def _raw(tokenizer_dir: Path, out_dir: Path, parallel: dict, optimizer: str = "muon", grad_accum: int = 1) -> dict:
    dp = parallel.get("dp", 1)
    raw = micro_run(tokenizer_dir, out_dir, parallel, GLOBAL_BATCH // dp // grad_accum, grad_accum, STEPS)
    raw["optim"]["optimizer"] = optimizer
    raw["train"]["checkpoint_every"] = 2
    return raw


def _seed_from(source: Path, target: Path, step: int) -> None:
    """`target` becomes a copy of run `source` as it was after `step` (later checkpoints removed)."""
    shutil.copytree(source, target)
    manager = CheckpointManager(target / "checkpoints")
    for later in range(step + 1, STEPS + 1):
        path = manager.path_for(later)
        if path.exists():
            shutil.rmtree(path)


def _jobs(rank: int, jobs: list[tuple[dict, int | None, bool, tuple | None]]) -> None:
    import openk2.train.trainer
    from openk2.train.parallel.trainer import ParallelTrainer

    openk2.train.trainer.plot_run = lambda run_dir: []  # plots are not under test and cost seconds per run
    for raw, max_steps, resume, seed in jobs:
        if seed is not None:
            if rank == 0:
                _seed_from(*seed)
            dist.barrier()
        ParallelTrainer(RunConfig.from_dict(raw), resume=resume).run(max_steps=max_steps)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, micro_tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp")
    tok = micro_tokenizer_dir
    fsdp = {"dp": 2, "shard": "fsdp2"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("openk2.train.trainer.plot_run", lambda run_dir: [])
        for optimizer in ("muon", "adamw"):
            Trainer(RunConfig.from_dict(_raw(tok, root / f"single-{optimizer}", {}, optimizer))).run()
    jobs = [(_raw(tok, root / "fsdp2-muon", fsdp), None, False, None),
            (_raw(tok, root / "fsdp2-adamw", fsdp, "adamw"), None, False, None),
            (_raw(tok, root / "fsdp2-accum2", fsdp, grad_accum=2), None, False, None),
            (_raw(tok, root / "fsdp2-resumed", fsdp), None, True, (root / "fsdp2-muon", root / "fsdp2-resumed", 2)),
            (_raw(tok, root / "zero1-from-fsdp2", {"dp": 2}), None, True,
             (root / "fsdp2-muon", root / "zero1-from-fsdp2", 2))]
    bf16 = {"param_dtype": "bfloat16"}
    run_ranks(1, _jobs, [(_raw(tok, root / "zero1-bf16", bf16), None, False, None)])  # one process, ZeRO-1's bf16
    jobs += [(_raw(tok, root / "fsdp2-bf16", {**fsdp, **bf16}), None, False, None),
             (_raw(tok, root / "fsdp2-from-single", fsdp), None, True,
              (root / "single-muon", root / "fsdp2-from-single", 2))]
    run_ranks(2, _jobs, jobs)
    _seed_from(root / "fsdp2-muon", root / "single-from-fsdp2", 2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("openk2.train.trainer.plot_run", lambda run_dir: [])
        Trainer(RunConfig.from_dict(_raw(tok, root / "single-from-fsdp2", {})), resume=True).run()
    return {p.name: p for p in root.iterdir() if p.is_dir()}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_fsdp2_matches_single_process(runs, optimizer):
    diff = assert_same_run(runs[f"fsdp2-{optimizer}"], runs[f"single-{optimizer}"], STEPS)
    got, want = records(runs[f"fsdp2-{optimizer}"]), records(runs[f"single-{optimizer}"])
    rel = max(abs(got[s]["loss"] / want[s]["loss"] - 1) for s in want)
    print(f"fsdp2 {optimizer}: largest weight difference after {STEPS} steps {diff:.2e}, loss rel {rel:.1e}, "
          f"clipped heads {[got[s]['clipped_heads'] for s in sorted(got)]}")
    saved = CheckpointManager(runs[f"fsdp2-{optimizer}"] / "checkpoints").path_for(STEPS)
    assert {p.name.split("_")[2] for p in (saved / "dcp").glob("*.distcp")} == {"0", "1"}  # each rank wrote


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_identically(runs):
    """The straight run's step-2 checkpoint, resumed under fsdp2: steps 3-4 and the weights bit for bit."""
    resumed, straight = records(runs["fsdp2-resumed"]), records(runs["fsdp2-muon"])
    assert [resumed[s]["loss"] for s in range(3, STEPS + 1)] == [straight[s]["loss"] for s in range(3, STEPS + 1)]
    weights = final_weights(runs["fsdp2-resumed"], STEPS)
    for name, value in final_weights(runs["fsdp2-muon"], STEPS).items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single-from-fsdp2", "zero1-from-fsdp2", "fsdp2-from-single"])
def test_fsdp2_checkpoint_reshards(runs, layout):
    """A fsdp2 checkpoint resumed by one process or by ZeRO-1, and a one-process checkpoint resumed under fsdp2,
    continue the single-process run."""
    assert_same_run(runs[layout], runs["single-muon"], STEPS)


@pytest.mark.slow
def test_fsdp2_with_gradient_accumulation_matches_single_process(runs):
    """2 micro-batches of 1 row per rank: each backward reduce-scatters and the shards accumulate."""
    assert_same_run(runs["fsdp2-accum2"], runs["single-muon"], STEPS)


@pytest.mark.slow
def test_fsdp2_bf16_compute_on_fp32_shards_matches_zero1_bf16(runs):
    """param_dtype = bfloat16: FSDP2 all-gathers bf16 copies of the fp32 shards (the masters) and reduce-scatters
    fp32 gradients; against one process with ZeRO-1's bf16 weights and fp32 masters, the losses agree to
    rel 1e-4 (each layout's bf16 backward rounds a different part of the gradient; measured: printed)."""
    got, want = records(runs["fsdp2-bf16"]), records(runs["zero1-bf16"])
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-4), step
        assert got[step]["clipped_heads"] == want[step]["clipped_heads"] > 0
    weights, expected = final_weights(runs["fsdp2-bf16"], STEPS), final_weights(runs["zero1-bf16"], STEPS)
    assert all(w.dtype == torch.float32 for w in weights.values())  # the shards are the fp32 masters
    config = json.loads((runs["zero1-bf16"] / "run_config.json").read_text())
    rate = config["optim"]["bias_update_rate"] or config["model"]["bias_update_rate"]
    rel, flips = {}, 0
    for name, value in expected.items():
        if name.endswith("e_score_correction_bias"):  # sign updates: a count tie broken by rounding moves one step
            steps = (weights[name] - value).abs() / rate
            assert bool((steps < 1 + 1e-3).all()), name
            flips += int((steps > 0.5).sum())
        else:
            rel[name] = float((weights[name] - value.float()).norm() / value.float().norm())
    print(f"fsdp2 bf16: loss rel {max(abs(got[s]['loss'] / want[s]['loss'] - 1) for s in want):.1e}, weights "
          f"relative L2 max {max(rel.values()):.3f} median {sorted(rel.values())[len(rel) // 2]:.4f}, "
          f"router-bias entries one update apart {flips}")
    assert max(rel.values()) < 0.05  # test_mixed.py's bound for two bf16 layouts
