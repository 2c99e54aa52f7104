"""`openk2 eval report` and BFCL's weighted overall: the report of a real (oracle) run lists scores with
intervals, the settings that decide comparability and the K2 report's numbers; the overall follows bfcl-eval's
formula with absent categories counted 0."""

from __future__ import annotations

import pytest

from openk2.cli.eval import eval_main
from openk2.eval.bfcl_overall import BENCHMARKS, overall
from openk2.eval.harness import run_eval
from openk2.eval.report import build_report, published


def test_bfcl_overall_follows_bfcls_formula():
    rows = {b: {"value": 1.0, "n": 10} for b in BENCHMARKS.values() if b}
    result = overall(rows)
    # Non-Live's simple is the mean of Python, Java, JavaScript: 1/3 without Java and JavaScript
    assert result["groups"]["non_live"] == pytest.approx((1 / 3 + 3) / 4)
    assert result["groups"]["live"] == result["groups"]["irrelevance"] == result["groups"]["multi_turn"] == 1.0
    assert result["groups"]["agentic"] == 0.0  # web search and memory are not offered
    assert result["overall"] == pytest.approx((10 * (1 / 3 + 3) / 4 + 10 + 10 + 30) / 100)
    assert result["complete_groups"] == ["live", "irrelevance", "multi_turn"] and result["present_only"] == 1.0
    assert set(result["categories_absent"]) == {c for c, b in BENCHMARKS.items() if b is None}
    # Live is weighted by count, the others are plain means
    rows["bfcl-live-simple"] = {"value": 0.0, "n": 30}
    assert overall(rows)["groups"]["live"] == pytest.approx(30 / 60)
    assert overall({})["overall"] == 0.0 and overall({})["present_only"] is None


def test_report_of_an_oracle_run(tmp_path, capsys):
    pytest.importorskip("bfcl_eval")
    pytest.importorskip("tau2")
    out = tmp_path / "run"
    run_eval("oracle", ["bfcl-simple", "bfcl-multi-turn", "tau2-retail"], out, limit=2, progress=False)
    text = build_report(out)
    assert "| bfcl-simple | accuracy | 100.0 | [" in text and "| tau2-retail | pass^1 | 100.0 |" in text
    assert "66.1 (τ²-Bench Pass@1" in text and published("bfcl-simple") is None
    assert "| max_steps | 200 |" in text and "| scorer | bfcl-eval 2026.3.23 ast_checker |" in text
    assert "| system_prompt | none |" in text and "## BFCL v4 overall" in text
    assert "simple_java" in text.split("Categories not run")[1]
    assert eval_main(["report", str(out)]) == 0
    assert (out / "report.md").read_text() == text and "report:" in capsys.readouterr().out


def test_cli_refuses_tau2_without_a_user_model_and_oracle_for_the_runner(tmp_path):
    with pytest.raises(SystemExit):
        eval_main(["--model", "openai:http://127.0.0.1:9/v1#x", "--benchmarks", "tau2-retail", "--out",
                   str(tmp_path)])
    with pytest.raises(SystemExit):
        eval_main(["--model", "oracle", "--benchmarks", "tau2-retail", "--runner", "tau2", "--out", str(tmp_path)])
