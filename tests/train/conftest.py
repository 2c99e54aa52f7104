"""A micro pre-training run (a few seconds) shared by the trainer tests."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from openk2.data.corpus import CorpusConfig, tokenizer_training_texts
from openk2.data.tokenizer import train_tokenizer

MICRO_MODEL = {
    "preset": "tiny", "vocab_size": 768, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 16,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 8,
}
MICRO_DATA = {"seq_len": 32, "val_fraction": 0.05, "sources": [{"kind": "math", "weight": 1.0, "num_docs": 300}]}


@pytest.fixture(scope="session")
def micro_tokenizer_dir(tmp_path_factory) -> Path:
    """One tokenizer for all micro runs, so runs in different processes see identical token ids."""
    out = tmp_path_factory.mktemp("tok")
    texts = tokenizer_training_texts(CorpusConfig.from_dict(copy.deepcopy(MICRO_DATA)), 200_000)
    train_tokenizer(texts, MICRO_MODEL["vocab_size"]).save(out)
    return out


@pytest.fixture
def micro_raw(tmp_path, micro_tokenizer_dir) -> dict:
    """A raw (TOML-shaped) run config: 8 steps of a 2-layer MoE on generated math, checkpoint every 2."""
    return {
        "out_dir": str(tmp_path / "run"),
        "model": dict(MICRO_MODEL),
        "tokenizer": {"path": str(micro_tokenizer_dir)},
        "data": copy.deepcopy(MICRO_DATA),
        "optim": {"lr": 1e-2, "ns_dtype": "float32"},
        "schedule": {"warmup_steps": 2, "decay_fraction": 0.25},
        "train": {"steps": 8, "batch_size": 4, "log_every": 1, "eval_every": 4, "eval_batches": 2,
                  "checkpoint_every": 2, "keep_checkpoints": 5, "threads": 1},
    }


def step_losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} of a run's metrics.jsonl (skipped steps left out)."""
    from openk2.train.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r and not r.get("skipped")}


def pretrain_killed_after(raw: dict, tmp_path: Path, run_dir: Path, step: int) -> list[str]:
    """Start `openk2 pretrain` on `raw` in a subprocess and SIGKILL it once `step` is logged; returns the command
    line (append --resume to continue the run)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import tomli_w

    config_file = tmp_path / "run.toml"
    config_file.write_text(tomli_w.dumps(raw))
    cmd = [sys.executable, "-m", "openk2", "pretrain", "--config", str(config_file), "--out", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        if (run_dir / "metrics.jsonl").is_file() and max(step_losses(run_dir), default=0) >= step:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return cmd
