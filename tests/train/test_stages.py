"""Training stages: config, live RoPE/YaRN switch, learning rate and tau per stage, resume inside a later stage."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import torch

from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM
from openk2.model.rope import softmax_scale
from openk2.train.checkpoint import CheckpointManager
from openk2.train.config import RunConfig, load_run_config
from openk2.train.dcp_resume import read_run_state
from openk2.train.metrics import read_metrics
from openk2.train.stages import StagePlan, apply_model_config, stage_model_config
from openk2.train.trainer import Trainer
from tests.train.conftest import pretrain_killed_after

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
YARN2 = {"factor": 2.0, "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 1.0}


def _staged(raw: dict) -> dict:
    """micro_raw as two stages: 4 steps at 32 tokens with plain RoPE, 4 at 64 tokens with YaRN x2 and half the batch."""
    raw = copy.deepcopy(raw)
    raw["train"].pop("steps")
    raw["stages"] = [{"name": "short", "steps": 4, "rope": "plain"},
                     {"name": "long", "steps": 4, "seq_len": 64, "batch_size": 2, "rope": "yarn", "yarn": YARN2,
                      "lr_ratio": 0.5, "lr_ratio_end": 0.1}]
    return raw


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r and not r.get("skipped")}


def test_no_stages_is_one_stage_and_the_config_round_trips(micro_raw):
    cfg = RunConfig.from_dict(micro_raw)
    plan = StagePlan(cfg)
    assert [s.name for s in plan.stages] == ["main"] and plan.stages[0].cfg is cfg and not plan.explicit
    assert plan.total_steps == plan.schedule_steps == cfg.train.steps
    assert "stages" not in cfg.to_dict()
    staged = RunConfig.from_dict(_staged(micro_raw))
    assert staged.train.steps == 8
    assert RunConfig.from_dict(json.loads(json.dumps(staged.to_dict()))).stages == staged.stages


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r["train"].update(steps=9), "stages add up to 8"),
    (lambda r: r["stages"][0].update(colour="red"), "colour"),
    (lambda r: r["stages"][1].update(name="short"), "unique"),
    (lambda r: r["stages"][0].update(yarn={"factor": 2.0}), "rope = \"yarn\""),
    (lambda r: r["stages"][1].update(yarn={"factor": 2.0}), "original_max_position_embeddings"),
    (lambda r: r["stages"][0].update(rope="ntk"), "rope must be one of"),
    (lambda r: r["stages"][0].update(steps=-1), "steps must be >= 0"),
    (lambda r: r["stages"].append({"name": "late", "steps": 2}), "covers only the leading stages"),
])
def test_bad_stage_configs_are_one_line_errors(micro_raw, change, message):
    raw = _staged(micro_raw)
    change(raw)
    with pytest.raises(ValueError, match=message):
        StagePlan(RunConfig.from_dict(raw))


def test_switching_rope_on_a_live_model_equals_a_fresh_model_with_that_config():
    plain = ModelConfig.preset("tiny").replace(num_hidden_layers=2, rope_scaling=None)
    yarn = plain.replace(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                       "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                         max_position_embeddings=256)
    torch.manual_seed(0)
    live = K2ForCausalLM(plain).eval()
    ids = torch.randint(0, plain.vocab_size, (2, 200))
    with torch.no_grad():
        before = live(ids).logits
        apply_model_config(live, yarn)
        switched = live(ids).logits
        fresh = K2ForCausalLM(yarn).eval()
        fresh.load_state_dict(live.state_dict())
        expected = fresh(ids).logits
        assert live.config == yarn
        assert torch.equal(switched, expected)
        assert not torch.allclose(switched, before)  # the switch did change the forward
        apply_model_config(live, plain)  # and back: the original forward again
        assert torch.equal(live(ids).logits, before)
    with pytest.raises(ValueError, match="hidden_size"):
        apply_model_config(live, plain.replace(hidden_size=128))


def test_k2_recipe_stages_follow_the_report():
    cfg = load_run_config(CONFIGS / "kimi-k2.toml")
    plan = StagePlan(cfg)
    names = [s.name for s in plan.stages]
    assert names == ["pretrain", "anneal", "long-context", "yarn-128k"]
    pre, anneal, long, ext = plan.stages
    assert pre.cfg.model.rope_scaling is None and anneal.cfg.model.rope_scaling is None  # no YaRN at 4k
    assert pre.cfg.data.seq_len == anneal.cfg.data.seq_len == 4096 and long.cfg.data.seq_len == 32768
    assert long.cfg.model.rope_scaling["factor"] == 32.0 and ext.cfg.model.max_position_embeddings == 131072
    tokens = lambda s: s.steps * s.cfg.train.batch_size * s.cfg.train.grad_accum * 256 * s.cfg.data.seq_len  # noqa: E731
    assert abs(tokens(pre) - 15.5e12) / 15.5e12 < 1e-3  # 15.5T tokens at 4k
    assert abs(tokens(anneal) - 400e9) / 400e9 < 1e-3 and abs(tokens(long) - 60e9) / 60e9 < 2e-3
    schedule = plan.build_schedule()
    assert plan.lr_at(0, schedule) < 2e-4 and plan.lr_at(1000, schedule) == pytest.approx(2e-4)
    assert plan.lr_at(pre.end - 1, schedule) == pytest.approx(2e-5, rel=1e-3)
    assert plan.lr_at(anneal.start, schedule) == pytest.approx(2e-5)
    assert plan.lr_at(anneal.end - 1, schedule) == pytest.approx(7e-6, rel=1e-3)
    # YaRN's mscale_all_dim raises the softmax scale by mscale(32)^2 = 1.81x; tau follows it.
    ratio = softmax_scale(long.cfg.model) / softmax_scale(pre.cfg.model)
    assert ratio == pytest.approx((0.1 * torch.log(torch.tensor(32.0)).item() + 1) ** 2)
    assert pre.tau == 100.0 and long.tau == pytest.approx(100.0 * ratio)


def test_yarn_stage_takes_the_models_own_yarn_keys():
    k2 = ModelConfig.preset("kimi-k2")
    from openk2.train.config import StageSection

    cfg = stage_model_config(k2, StageSection(name="x", steps=1, rope="yarn", yarn={"factor": 8.0}))
    assert cfg.rope_scaling["factor"] == 8.0 and cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert stage_model_config(k2, StageSection(name="y", steps=1, rope="plain")).rope_scaling is None


def test_two_stage_run_tags_metrics_switches_rope_and_resumes_in_stage_two(micro_raw, tmp_path, capsys):
    raw = _staged(micro_raw)
    straight = Trainer(RunConfig.from_dict(raw), out_dir=tmp_path / "straight")
    summary = straight.run()
    assert summary.step == 8
    err = capsys.readouterr().err  # not a terminal: the stage switch and flushed progress lines are printed
    assert "stage 2/2 'long': steps 5-8, seq_len 64, batch 2x1, yarn x2 over 32" in err
    assert "pretrain [long] step 8/8 loss" in err
    records = [r for r in read_metrics(tmp_path / "straight") if "loss" in r]
    assert [r["stage"] for r in records] == ["short"] * 4 + ["long"] * 4
    assert [r["lr"] for r in records][4:] == pytest.approx([1e-2 * (0.5 - 0.4 * i / 4) for i in range(4)])
    assert straight.model.config.rope_scaling["type"] == "yarn" and straight.train_loader.config.seq_len == 64
    exported = json.loads((summary.checkpoint / "config.json").read_text())
    assert exported["rope_scaling"]["factor"] == 2.0
    assert read_run_state(summary.checkpoint)["stage"] == {"index": 1, "name": "long"}

    # Stop inside stage 2 (step 6; checkpoints every 2 steps), resume: the same per-step losses.
    Trainer(RunConfig.from_dict(raw), out_dir=tmp_path / "cut").run(max_steps=6)
    resumed = Trainer(RunConfig.from_dict(raw), out_dir=tmp_path / "cut", resume=True)
    assert resumed.step == 6 and resumed.stage.name == "long" and resumed.model.config.rope_scaling is not None
    resumed.run()
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "straight")


def test_resume_at_a_stage_boundary_enters_the_next_stage(micro_raw, tmp_path):
    raw = _staged(micro_raw)
    Trainer(RunConfig.from_dict(raw), out_dir=tmp_path / "straight").run()
    Trainer(RunConfig.from_dict(raw), out_dir=tmp_path / "cut").run(max_steps=4)
    resumed = Trainer(RunConfig.from_dict(raw), out_dir=tmp_path / "cut", resume=True)
    assert resumed.stage.name == "short"  # the checkpoint was written in stage 1; step 5 switches
    resumed.run()
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "straight")


@pytest.mark.slow
def test_sigkill_inside_a_later_stage_and_resume_reproduces_the_run(micro_raw, tmp_path):
    raw = _staged(micro_raw)
    # A long second stage, so the kill (from a polling loop) lands inside it however fast the machine steps.
    raw["stages"][1]["steps"] = 36
    Trainer(RunConfig.from_dict(raw), out_dir=tmp_path / "straight").run()
    expected = _losses(tmp_path / "straight")
    killed_dir = tmp_path / "killed"
    # killed once step 7 is logged: the newest checkpoint is >= step 6, in stage 2
    cmd = pretrain_killed_after(raw, tmp_path, killed_dir, 7)
    assert max(_losses(killed_dir)) < 40, "the run finished before it could be killed"
    newest = CheckpointManager(killed_dir / "checkpoints").latest().name
    assert int(newest.removeprefix("step-")) >= 6  # written inside stage 2 (steps 5..40)
    resumed = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "'long'" in resumed.stderr
    assert _losses(killed_dir) == expected  # bit-identical per-step losses in fp32
