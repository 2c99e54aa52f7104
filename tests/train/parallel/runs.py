"""Run configs and metric readers shared by the full-mesh and multi-node tests (micro model, QK-Clip firing)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from openk2.train.checkpoint import CheckpointManager
from openk2.train.hf_export import read_model_state
from openk2.train.metrics import read_metrics


def micro_run(tokenizer_dir: Path, out_dir: Path, parallel: dict, batch_size: int, grad_accum: int,
              steps: int) -> dict:
    """A raw run config: a 4-layer MoE (1 dense + 3 MoE, 8 experts), fp32, QK-Clip at tau 0.04 (clips every
    step), checkpoint and validation at the last step; `batch_size` rows per data rank per micro-batch."""
    from tests.train.conftest import MICRO_DATA, MICRO_MODEL

    return {
        "out_dir": str(out_dir),
        "model": {**MICRO_MODEL, "num_hidden_layers": 4, "aux_loss_alpha": 0.0},
        "tokenizer": {"path": str(tokenizer_dir)}, "data": copy.deepcopy(MICRO_DATA),
        "optim": {"lr": 1e-2, "ns_dtype": "float32", "qk_clip_tau": 0.04},
        "schedule": {"warmup_steps": 2, "decay_fraction": 0.25},
        "train": {"steps": steps, "batch_size": batch_size, "grad_accum": grad_accum, "precision": "fp32",
                  "log_every": 1, "eval_every": steps, "eval_batches": grad_accum, "checkpoint_every": steps,
                  "keep_checkpoints": 2, "threads": 1},
        "parallel": parallel,
    }


def records(run_dir: Path) -> dict[int, dict]:
    """Logged training records by step."""
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The full model of the checkpoint at `step` (read from DCP shards or safetensors)."""
    return read_model_state(CheckpointManager(run_dir / "checkpoints").path_for(step))


def assert_same_run(run_dir: Path, reference: Path, steps: int, atol: float = 1e-5) -> float:
    """Per-step losses (rel 1e-5), clipped heads (> 0), tokens, final val loss and weights (abs `atol`) equal;
    returns the largest weight difference."""
    import pytest

    got, want = records(run_dir), records(reference)
    assert sorted(got) == sorted(want) == list(range(1, steps + 1))
    for step, expected in want.items():
        assert got[step]["loss"] == pytest.approx(expected["loss"], rel=1e-5), f"step {step}"
        assert got[step]["clipped_heads"] == expected["clipped_heads"] > 0
        assert got[step]["tokens"] == expected["tokens"]
    assert got[steps]["val_loss"] == pytest.approx(want[steps]["val_loss"], rel=1e-5)
    weights, expected = final_weights(run_dir, steps), final_weights(reference, steps)
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=atol, msg=name)
    return max(float((weights[n] - v).abs().max()) for n, v in expected.items())
