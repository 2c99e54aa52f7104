"""Experiment plumbing on a micro budget (seconds per arm): reports, plots, listing, reproducibility, and the
pure helpers (token-efficiency interpolation, clip summary, inference FLOPs). The conclusions are not tested."""

from __future__ import annotations

import json

import pytest
import torch

from openk2.cli import main as openk2_main
from openk2.cli.experiment import experiment_main, list_experiments
from openk2.config import ModelConfig
from openk2.experiments import EXPERIMENTS
from openk2.experiments.common import Curve, tokens_to_reach
from openk2.experiments.heads import inference_flops_per_token
from openk2.experiments.qk_clip import InductionTask, clip_summary

MINE = ("muon-vs-adamw", "qk-clip", "sparsity", "heads")


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    """One runs directory per module, so the micro tokenizer under `_shared` is trained once."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture
def micro(monkeypatch):
    monkeypatch.setenv("OPENK2_EXPERIMENT_MICRO", "1")


def _section(report: str, name: str) -> str:
    return report.split(f"## {name}", 1)[1].split("\n## ", 1)[0]


def _run(runs_dir, name: str, sub: str, seed: int = 0) -> str:
    out = runs_dir / sub
    assert experiment_main([name, "--quick", "--seed", str(seed), "--out-dir", str(out)]) == 0
    report = (out / "report.md").read_text()
    for section in ("Setup", "Results", "Conclusion", "Plots", "Reproduce"):
        assert f"## {section}" in report
    assert f"openk2 experiment {name} --quick --seed {seed}" in report
    for line in report.splitlines():  # every plot the report embeds was written
        if line.startswith("!["):
            assert (out / line.split("(")[1].rstrip(")")).stat().st_size > 1000
    return report


def test_registry_holds_the_four_experiments():
    assert all(name in EXPERIMENTS for name in MINE)


def test_tokens_to_reach_interpolates_between_validation_points():
    curve = Curve("x", tokens=[100, 200, 300], val_loss=[3.0, 2.0, 1.0], seconds=1.0, tokens_per_s=1.0, config={})
    assert tokens_to_reach(curve, 1.5) == pytest.approx(250.0)
    assert tokens_to_reach(curve, 3.5) == 100.0
    assert tokens_to_reach(curve, 0.5) is None


def test_clip_summary_counts_heads_ever_clipped_and_the_last_active_step():
    mask = torch.zeros(10, 2, 4, dtype=torch.bool)
    mask[1, 0, 3] = mask[2, 1, 0] = mask[2, 0, 3] = True
    summary = clip_summary({"clipped": mask.tolist()})
    assert (summary["heads_ever_clipped"], summary["heads"]) == (2, 8)
    assert summary["fraction"] == 0.25
    assert (summary["clip_steps"], summary["last_clip_step"], summary["last_clip_share"]) == (2, 3, 0.3)


def test_induction_rows_repeat_their_segment():
    rows = InductionTask(vocab=8, segment=5, repeats=3).batch(4, torch.Generator().manual_seed(0))
    assert rows.shape == (4, 15)
    assert torch.equal(rows[:, :5], rows[:, 5:10]) and torch.equal(rows[:, :5], rows[:, 10:])


def test_inference_flops_grow_with_heads_and_context():
    k2 = ModelConfig.preset("kimi-k2")
    double = k2.replace(num_attention_heads=128)
    per_key = 2 * k2.num_hidden_layers * k2.num_attention_heads * (k2.qk_head_dim + k2.v_head_dim)
    assert inference_flops_per_token(k2, 2000) - inference_flops_per_token(k2, 1000) == pytest.approx(per_key * 1000)
    assert inference_flops_per_token(double, 131072) / inference_flops_per_token(k2, 131072) > 1.5


def test_unknown_experiment_is_a_one_line_error(capsys):
    assert openk2_main(["experiment", "no-such-thing"]) == 2
    err = capsys.readouterr().err
    assert "unknown experiment 'no-such-thing'" in err and "Traceback" not in err


def test_list_shows_descriptions_and_existing_reports(tmp_path, capsys):
    (tmp_path / "heads-quick-seed0").mkdir()
    (tmp_path / "heads-quick-seed0" / "report.md").write_text("# Attention heads doubled (quick)\n")
    assert experiment_main(["list", "--runs-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in MINE:
        assert name in out
    assert "Attention heads doubled (quick)" in out and "heads-quick-seed0" in out
    assert "no runs under" in list_experiments(tmp_path / "empty")


def test_qk_clip_micro_writes_report_and_clips(micro, runs_dir):
    report = _run(runs_dir, "qk-clip", "qk")
    runs = json.loads((runs_dir / "qk" / "runs.json").read_text())
    assert len(runs["vanilla"]["max_logit"]) == len(runs["muonclip"]["loss"]) == 12
    assert not any(any(row) for step in runs["vanilla"]["clipped"] for row in step)  # tau=None never clips
    assert "heads" in _section(report, "Results") and "ever clipped" in _section(report, "Results")


@pytest.mark.slow
def test_sparsity_micro_rerun_with_the_same_seed_reproduces_the_table(micro, runs_dir):
    first = _section(_run(runs_dir, "sparsity", "s-a", seed=3), "Results")
    second = _section(_run(runs_dir, "sparsity", "s-b", seed=3), "Results")
    assert first == second
    assert all(f"| {s} | {2 * s} |" in first for s in (8, 16, 32, 48))


@pytest.mark.slow
def test_muon_vs_adamw_and_heads_micro(micro, runs_dir):
    report = _run(runs_dir, "muon-vs-adamw", "mva")
    results = _section(report, "Results")
    assert results.count("| yes |") == 2  # one best arm per optimizer
    assert "Tokens Muon (best lr) needs" in results
    # a finished arm is read back, not retrained: the rerun leaves its curve file untouched
    curve_file = next((runs_dir / "mva").glob("arm0-*/curve.json"))
    stamp = curve_file.stat().st_mtime_ns
    _run(runs_dir, "muon-vs-adamw", "mva")
    assert curve_file.stat().st_mtime_ns == stamp

    heads = _section(_run(runs_dir, "heads", "heads"), "Results")
    assert "| 4 heads |" in heads and "| 8 heads |" in heads
    assert "kimi-k2 preset, analytic" in heads


def test_default_out_dir_names_the_scale_so_runs_at_other_budgets_are_not_reused(tmp_path):
    from openk2.cli.experiment import default_out_dir

    assert default_out_dir(tmp_path, "qk-clip", "quick", 0).name == "qk-clip-quick-seed0"
    assert default_out_dir(tmp_path, "qk-clip", "quick", 0, scale=0.5).name == "qk-clip-quick-x0.5-seed0"
    assert default_out_dir(tmp_path, "qk-clip", "quick", 1, seeds=3, scale=0.5).name == "qk-clip-quick-x0.5-seeds1-3"
