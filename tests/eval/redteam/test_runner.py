"""The grid runner: pass rates per cell, the files it writes, resume after a partial JSONL, settings guard."""

from __future__ import annotations

import json

import pytest

from openk2.eval.harness import read_records
from openk2.eval.redteam.runner import plan_attempts, run_redteam
from openk2.eval.redteam.strategies import AttackSettings, Roles, strategy_names

from .fakes import CompliantTarget, KeywordJudge, NumberedAttacker, RefusingTarget

FAST = AttackSettings(iterations=2, turns=2)
QUIET = dict(settings=FAST, progress=False, heatmap=False)  # the heatmap is checked once, in test_files_written


def _roles(target):
    return Roles(target, NumberedAttacker(), KeywordJudge())


def test_refusing_target_scores_100_and_compliant_0_on_the_full_grid(tmp_path):
    safe = run_redteam(_roles(RefusingTarget()), tmp_path / "safe", per_cell=2, **QUIET)
    unsafe = run_redteam(_roles(CompliantTarget()), tmp_path / "unsafe", per_cell=2, **QUIET)
    assert safe["overall"]["value"] == 1.0 and safe["overall"]["n"] == 5 * 5 * 2
    assert unsafe["overall"]["value"] == 0.0
    for payload, expected in ((safe, 1.0), (unsafe, 0.0)):
        assert all(cell["value"] == expected and cell["n"] == 2
                   for row in payload["cells"].values() for cell in row.values())
    # Wilson interval at 2/2: the lower bound is far from 1 (n is tiny), the upper bound is 1
    cell = safe["cells"]["privacy"]["crescendo"]
    assert cell["high"] == 1.0 and 0.1 < cell["low"] < 0.5
    assert safe["judge_fallbacks"] == 0 and safe["errors"] == 0


def test_files_written(tmp_path):
    out = tmp_path / "run"
    run_redteam(_roles(RefusingTarget()), out, plugins=["security", "privacy"], strategies=["basic", "crescendo"],
                per_cell=3, seed=7, settings=FAST, progress=False)
    records = read_records(out / "attempts.jsonl")
    assert len(records) == 2 * 2 * 3
    rec = next(r for r in records if r["id"] == "privacy/crescendo/1")
    assert rec["goal"] == "privacy-doxx" and rec["verdict"] == "PASS" and rec["judge_method"] == "judge"
    assert [m["role"] for m in rec["conversation"]] == ["user", "assistant"] * 2
    results = json.loads((out / "results.json").read_text())
    assert list(results["cells"]) == ["security", "privacy"] and results["settings"]["seed"] == 7
    table = (out / "table.md").read_text()
    assert "| Security | 100% [44, 100] n=3 | 100% [44, 100] n=3 |" in table and "Crescendo" in table
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_after_a_partial_jsonl_runs_only_what_is_missing(tmp_path):
    out = tmp_path / "run"
    kwargs = dict(plugins=["criminal"], strategies=["basic", "base64"], per_cell=2, **QUIET)
    first = run_redteam(_roles(RefusingTarget()), out, **kwargs)
    path = out / "attempts.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == 4
    path.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])  # a crash mid-write of record 3

    target = RefusingTarget()
    second = run_redteam(_roles(target), out, **kwargs)
    assert len(target.calls) == 2  # only the two lost attempts ran again (one target call each)
    records = read_records(path)
    assert sorted(r["id"] for r in records) == sorted(["criminal/basic/0", "criminal/basic/1",
                                                       "criminal/base64/0", "criminal/base64/1"])
    assert second["overall"] == first["overall"]
    # nothing left: a third run calls no model at all
    target = RefusingTarget()
    run_redteam(_roles(target), out, **kwargs)
    assert target.calls == []


def test_failed_attempts_are_recorded_left_out_and_retried(tmp_path, capsys):
    class FlakyTarget(RefusingTarget):
        def chat(self, messages, tools=None, **sampling):
            raise ConnectionError("endpoint down")

    out = tmp_path / "run"
    kwargs = dict(plugins=["harmful"], strategies=["basic"], per_cell=2, **QUIET)
    payload = run_redteam(_roles(FlakyTarget()), out, **kwargs)
    assert payload["errors"] == 2 and payload["overall"]["n"] == 0 and payload["overall"]["value"] is None
    assert "endpoint down" in capsys.readouterr().out
    assert all(r["verdict"] is None for r in read_records(out / "attempts.jsonl"))
    payload = run_redteam(_roles(RefusingTarget()), out, **kwargs)
    assert payload["errors"] == 0 and payload["overall"]["n"] == 2


def test_resume_refuses_other_settings(tmp_path):
    out = tmp_path / "run"
    run_redteam(_roles(RefusingTarget()), out, plugins=["harmful"], strategies=["basic"], per_cell=1,
                **QUIET)
    with pytest.raises(ValueError, match="other settings.*target"):
        run_redteam(_roles(CompliantTarget()), out, plugins=["harmful"], strategies=["basic"], per_cell=1,
                    **QUIET)


def test_concurrent_run_matches_sequential(tmp_path):
    kwargs = dict(plugins=["misinformation", "privacy"], per_cell=2, **QUIET)
    one = run_redteam(_roles(RefusingTarget()), tmp_path / "a", **kwargs)
    many = run_redteam(_roles(RefusingTarget()), tmp_path / "b", concurrency=4, **kwargs)
    assert one["cells"] == many["cells"]
    ids = sorted(r["id"] for r in read_records(tmp_path / "b" / "attempts.jsonl"))
    assert ids == sorted(s.id for s in plan_attempts(["misinformation", "privacy"], strategy_names(), 2, 0))


def test_plan_cycles_goals_and_rejects_bad_input():
    specs = plan_attempts(["privacy"], ["basic"], 4, 0)
    assert [s.goal.id for s in specs] == ["privacy-address", "privacy-doxx", "privacy-records", "privacy-address"]
    assert len({s.seed for s in specs}) == 4
    assert [s.seed for s in plan_attempts(["privacy"], ["basic"], 4, 0)] == [s.seed for s in specs]
    with pytest.raises(ValueError, match="unknown plugin 'violence'"):
        plan_attempts(["violence"], ["basic"], 1, 0)
    with pytest.raises(ValueError, match="unknown strategy"):
        plan_attempts(["privacy"], ["leetspeak"], 1, 0)
    with pytest.raises(ValueError, match="per_cell"):
        plan_attempts(["privacy"], ["basic"], 0, 0)
