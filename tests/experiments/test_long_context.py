"""The long-context experiment (micro budget: plumbing, not conclusions), the passkey task, `--seeds N` with 95%
intervals, and the flushed progress lines an experiment prints when its output is not a terminal."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from openk2.cli.experiment import experiment_main
from openk2.experiments.common import progress
from openk2.experiments.long_context import ARMS, PasskeyTask
from openk2.experiments.seeds import mean_ci, seed_metrics, t_quantile


@pytest.fixture
def micro(monkeypatch):
    monkeypatch.setenv("OPENK2_EXPERIMENT_MICRO", "1")


def test_passkey_rows_hold_the_needle_and_the_query_with_the_same_digits():
    task = PasskeyTask(digits=8)
    ids, filler = task.batch(16, 40, torch.Generator().manual_seed(0))
    m = task.digits
    assert ids.shape == filler.shape == (16, 40)
    assert (ids[:, 40 - m - 1] == task.key).all()
    for row, mask in zip(ids, filler, strict=True):
        where = (row == task.key).nonzero().flatten()
        assert len(where) == 2 and int(where[1]) == 40 - m - 1
        p = int(where[0])
        assert torch.equal(row[p + 1 : p + 1 + m], row[40 - m :])  # the query's digits are the needle's
        assert ((row[mask] < task.filler).all() and (~mask).sum() == 2 * (m + 1))
        assert len(set(row[p + 1 : p + 1 + m].tolist())) == m  # distinct symbols: the copy is unambiguous
    probs = task.transitions()
    assert torch.allclose(probs.sum(1), torch.ones(task.filler)) and ((probs > 0).sum(1) == task.successors).all()
    with pytest.raises(ValueError, match="cannot hold"):
        task.batch(1, 8, torch.Generator())
    with pytest.raises(ValueError, match="distinct symbols"):
        PasskeyTask(digits=40).batch(1, 128, torch.Generator())


def test_t_interval_matches_the_textbook_formula():
    values = [1.0, 2.0, 4.0]
    mean, half = mean_ci(values)
    assert mean == pytest.approx(7 / 3)
    assert half == pytest.approx(4.303 * statistics.stdev(values) / math.sqrt(3))
    assert math.isnan(mean_ci([5.0])[1])
    assert t_quantile(1) == 12.706 and t_quantile(22) == 2.060 and t_quantile(100) == 1.96
    with pytest.raises(ValueError):
        mean_ci([])


def test_progress_prints_flushed_lines_without_a_terminal(capsys):
    assert list(progress(range(3), "demo", every_s=0.0)) == [0, 1, 2]
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("demo: 0/3 ") and err[-1].startswith("demo: 3/3 ") and len(err) == 4  # start + 3 steps


@pytest.mark.slow
def test_long_context_micro_run_with_two_seeds_writes_reports_and_intervals(micro, tmp_path, capsys):
    out = tmp_path / "lc"
    assert experiment_main(["long-context", "--quick", "--seed", "3", "--seeds", "2", "--out-dir", str(out)]) == 0
    assert "[seed 4: 2/2] long-context" in capsys.readouterr().err
    for seed in (3, 4):
        report = (out / f"seed{seed}" / "report.md").read_text()
        for section in ("Setup", "Results", "Conclusion", "Plots", "Reproduce"):
            assert f"## {section}" in report
        for arm in ARMS:
            assert arm in report
        for png in ("passkey.png", "loss_by_position.png"):
            assert (out / f"seed{seed}" / png).stat().st_size > 1000
        metrics = seed_metrics(out / f"seed{seed}")
        assert len(metrics) == 9 * len(ARMS) and all(0 <= v <= 1 for k, v in metrics.items() if "acc" in k)
    summary = json.loads((out / "summary.json").read_text())
    key = f"filler loss @4x, {ARMS[3]}"
    values = [seed_metrics(out / f"seed{s}")[key] for s in (3, 4)]
    assert summary["metrics"][key]["values"] == values
    assert summary["metrics"][key]["ci95"] == pytest.approx(mean_ci(values)[1])
    assert values[0] != values[1]  # the seeds differ
    report = (out / "report.md").read_text()
    assert "2 seeds" in report and "--seed 3 --seeds 2" in report and key in report
    assert "![seeds](seeds.png)" in report and (out / "seeds.png").stat().st_size > 1000
    # Reproducible: the same command reads every seed back and writes the same summary.
    before = (out / "summary.json").read_text()
    assert experiment_main(["long-context", "--quick", "--seed", "3", "--seeds", "2", "--out-dir", str(out)]) == 0
    assert (out / "summary.json").read_text() == before


def test_seeds_must_be_positive():
    with pytest.raises(ValueError, match="--seeds"):
        experiment_main(["long-context", "--seeds", "0"])
