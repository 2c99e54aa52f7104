"""The pre-training loop: exact resume after SIGKILL, corrupted checkpoints, HF loading, bad steps, MuonClip."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from openk2.train.checkpoint import CheckpointManager
from openk2.train.config import RunConfig, load_run_config
from openk2.train.metrics import read_metrics
from openk2.train.trainer import BadStepError, Trainer
from tests.train.conftest import pretrain_killed_after


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r and not r.get("skipped")}


@pytest.mark.slow
def test_sigkill_and_resume_reproduces_the_uninterrupted_run(micro_raw, tmp_path):
    # 24 steps, so the kill (from a polling loop) lands well before the end however fast the machine steps
    micro_raw["train"]["steps"] = 24
    straight = Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "straight")
    straight.run()
    expected = _losses(tmp_path / "straight")
    assert sorted(expected) == list(range(1, 25))

    killed_dir = tmp_path / "killed"
    # killed once step 5 is logged: checkpoints exist for steps 2 and 4 (and perhaps a few more)
    cmd = pretrain_killed_after(micro_raw, tmp_path, killed_dir, 5)
    assert max(_losses(killed_dir)) < 24, "the run finished before it could be killed"

    resumed = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    assert _losses(killed_dir) == expected  # bit-identical per-step losses in fp32


def test_truncated_checkpoint_falls_back_to_the_previous_one(micro_raw, tmp_path, capsys):
    cfg = RunConfig.from_dict(micro_raw)
    Trainer(cfg, out_dir=tmp_path / "r").run(max_steps=4)
    manager = CheckpointManager(tmp_path / "r" / "checkpoints")
    latest = manager.path_for(4)
    weights = latest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    trainer = Trainer(cfg, out_dir=tmp_path / "r", resume=True)
    assert trainer.step == 2
    assert "skipping checkpoint" in capsys.readouterr().err


def test_max_steps_keeps_the_schedule_and_always_checkpoints(micro_raw, tmp_path):
    cfg = RunConfig.from_dict(micro_raw)
    summary = Trainer(cfg, out_dir=tmp_path / "r").run(max_steps=3)
    assert summary.step == 3 and summary.checkpoint.name == "step-0000003"
    records = {r["step"]: r for r in read_metrics(tmp_path / "r")}
    full = cfg.schedule.build(cfg.train.steps, cfg.optim.lr)
    from openk2.optim.schedule import wsd_lr

    assert records[3]["lr"] == pytest.approx(wsd_lr(2, full))


def test_checkpoint_loads_in_transformers(micro_raw, tmp_path):
    transformers = pytest.importorskip("transformers")
    summary = Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "r").run(max_steps=2)
    from openk2 import K2ForCausalLM

    ours = K2ForCausalLM.from_pretrained(summary.checkpoint, dtype=torch.float32).eval()
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(summary.checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(0, 768, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)


def _poison_step(trainer: Trainer, bad_step: int) -> None:
    forward = trainer.model.forward

    def poisoned(*args, **kwargs):
        out = forward(*args, **kwargs)
        if trainer.step + 1 == bad_step and trainer.model.training:
            out.loss = out.loss * float("nan")
        return out

    trainer.model.forward = poisoned


def test_nan_loss_skips_the_update_or_stops(micro_raw, tmp_path, capsys):
    trainer = Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "skip")
    _poison_step(trainer, 3)
    trainer.run(max_steps=2)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.run(max_steps=3)
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in before.items())
    assert "step 3: non-finite loss" in capsys.readouterr().err
    assert any(r.get("skipped") for r in read_metrics(tmp_path / "skip"))

    micro_raw["train"]["on_bad_step"] = "stop"
    trainer = Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "stop")
    _poison_step(trainer, 2)
    with pytest.raises(BadStepError, match="step 2: non-finite loss"):
        trainer.run()
    assert CheckpointManager(tmp_path / "stop" / "checkpoints").latest().name == "step-0000002"


def test_muonclip_training_decreases_loss_and_logs_clipping(micro_raw, tmp_path):
    tau = 0.08  # this micro model starts near 0.05 and grows past 0.13 by step 12 without clipping
    micro_raw["optim"]["qk_clip_tau"] = tau
    micro_raw["train"]["steps"] = 12
    Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "r").run()
    records = [r for r in read_metrics(tmp_path / "r") if "loss" in r]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert sum(r["clipped_heads"] for r in records) > 0
    # Each step's logits come from weights clipped at the step before, plus one update's growth.
    assert max(r["max_logit"] for r in records[-4:]) < 1.5 * tau
    assert all(len(r["max_logit_per_layer"]) == 2 for r in records)
    assert (tmp_path / "r" / "max_logit.png").is_file()


def test_config_errors_are_clear(tmp_path, micro_raw):
    with pytest.raises(ValueError, match=r"unknown key\(s\) in \[train\]: stepz"):
        RunConfig.from_dict({**micro_raw, "train": {"stepz": 3}})
    with pytest.raises(ValueError, match="unknown section"):
        RunConfig.from_dict({"trian": {}})
    with pytest.raises(ValueError, match="not found"):
        load_run_config(tmp_path / "missing.toml")
    cfg = load_run_config(None, ["optim.lr=5e-4", "train.precision=fp32", "model.num_hidden_layers=3"])
    assert cfg.optim.lr == 5e-4 and cfg.train.precision == "fp32" and cfg.model.num_hidden_layers == 3


def test_shipped_configs_parse():
    """Every file in configs/ parses with the loader of the command it is for (by its name's prefix)."""
    from openk2.agentic.synth_config import load_synth_config
    from openk2.pipeline.config import load_pipeline_config
    from openk2.rl.config import load_rl_config

    loaders = {"rl-": load_rl_config, "synth-": load_synth_config, "pipeline-": load_pipeline_config}
    root = Path(__file__).resolve().parents[2] / "configs"
    paths = sorted(root.glob("*.toml"))
    assert len(paths) >= 5
    for path in paths:
        load = next((f for prefix, f in loaders.items() if path.name.startswith(prefix)), load_run_config)
        load(path)


def test_config_inheritance(tmp_path):
    (tmp_path / "base.toml").write_text('out_dir = "a"\n[optim]\nlr = 0.5\nweight_decay = 0.2\n')
    (tmp_path / "child.toml").write_text('base = "base.toml"\n[optim]\nlr = 0.25\n')
    cfg = load_run_config(tmp_path / "child.toml")
    assert (cfg.out_dir, cfg.optim.lr, cfg.optim.weight_decay) == ("a", 0.25, 0.2)
    (tmp_path / "loop.toml").write_text('base = "loop.toml"\n')
    with pytest.raises(ValueError, match="loops"):
        load_run_config(tmp_path / "loop.toml")


def test_adamw_baseline_trains_and_resumes(micro_raw, tmp_path):
    micro_raw["optim"].update(optimizer="adamw", lr=3e-3)
    cfg = RunConfig.from_dict(micro_raw)
    trainer = Trainer(cfg, out_dir=tmp_path / "r")
    assert trainer.optimizer.muon is None
    trainer.run(max_steps=4)
    records = [r for r in read_metrics(tmp_path / "r") if "loss" in r]
    assert records[-1]["loss"] < records[0]["loss"]
    assert Trainer(cfg, out_dir=tmp_path / "r", resume=True).step == 4
    micro_raw["optim"]["optimizer"] = "muon"
    with pytest.raises(ValueError, match="different optimizer"):
        Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "r", resume=True)


def test_bf16_autocast_trains_with_fp32_master_weights(micro_raw, tmp_path):
    micro_raw["train"]["precision"] = "bf16"
    trainer = Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "r")
    assert trainer.autocast_dtype == torch.bfloat16
    trainer.run(max_steps=2)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in read_metrics(tmp_path / "r") if "loss" in r)


def test_missing_tokenizer_path_is_an_error(micro_raw, tmp_path):
    micro_raw["tokenizer"]["path"] = str(tmp_path / "no-such-tokenizer")
    with pytest.raises(ValueError, match="tokenizer.path .* does not exist"):
        Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "r")
