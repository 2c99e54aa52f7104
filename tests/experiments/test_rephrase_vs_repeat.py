"""rephrase-vs-repeat: the arms' data, the held-out split, the probe's scoring, and the whole run on a micro budget."""

from __future__ import annotations

import json

import pytest
import torch

from openk2.cli.experiment import experiment_main
from openk2.config import ModelConfig
from openk2.data.corpus import CorpusConfig, corpus_documents
from openk2.data.knowledge import make_entities, qa_items, raw_document
from openk2.data.tokenizer import train_tokenizer
from openk2.experiments import EXPERIMENTS
from openk2.experiments.rephrase_vs_repeat import (
    VAL_SOURCE_VAL_FRACTION,
    arm_corpora,
    candidate_scores,
    majority_baseline,
    verdict,
    write_arm_source,
)
from openk2.model import K2ForCausalLM


def test_arms_hold_the_same_facts_in_one_and_ten_versions():
    entities = make_entities(20, seed=1)
    arms = arm_corpora(entities, seed=1)
    assert len(arms["raw-x10"]) == len(arms["rephrase1-x10"]) == 20 and len(arms["rephrase10-x1"]) == 200
    assert arms["rephrase1-x10"] == arms["rephrase10-x1"][:20]  # copy 0 is the single rephrasing
    assert len(set(arms["rephrase10-x1"])) == 200


@pytest.mark.parametrize("seed", [0, 3])
def test_only_the_filler_document_is_held_out(tmp_path, seed):
    docs = [raw_document(e) for e in make_entities(57, seed=seed)]
    write_arm_source(docs + docs[:3], "VALIDATION TEXT", tmp_path / "a.jsonl", seed)  # duplicates are dropped
    cfg = CorpusConfig.from_dict({"val_fraction": VAL_SOURCE_VAL_FRACTION, "seed": seed, "sources": [
        {"kind": "jsonl", "name": "knowledge", "path": str(tmp_path / "a.jsonl")}]})
    split = corpus_documents(cfg)["knowledge"]
    assert split["val"] == ["VALIDATION TEXT"] and sorted(split["train"]) == sorted(docs)


def test_candidate_scores_match_an_unpadded_forward():
    entities = make_entities(3, seed=0)
    items = qa_items(entities)[:4]
    tok = train_tokenizer([raw_document(e) for e in entities] * 3, 512)
    torch.manual_seed(0)
    model = K2ForCausalLM(ModelConfig.preset("tiny").replace(
        vocab_size=512, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)).eval()
    scores = candidate_scores(model, tok, items, batch_size=7)  # batches cut across items
    assert [len(s) for s in scores] == [16] * 4
    item, k = items[2], 5
    prompt, cand = [tok.eos_id, *tok.encode(item.prompt)], tok.encode(" " + item.candidates[k])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + cand])).logits[0].float(), -1)
    expected = sum(logp[len(prompt) - 1 + j, t] for j, t in enumerate(cand))
    assert scores[2][k].item() == pytest.approx(float(expected), abs=1e-4)


def test_majority_baseline_is_above_uniform_chance():
    entities = make_entities(240, seed=0)
    assert 1 / 16 < majority_baseline(entities) < 0.2


def test_verdict_follows_the_numbers():
    def res(raw, one, ten):
        return {"raw-x10": {"qa_accuracy": raw}, "rephrase1-x10": {"qa_accuracy": one},
                "rephrase10-x1": {"qa_accuracy": ten}}

    n = 1000
    assert "agrees with the report's claim: both" in verdict(res(0.2, 0.26, 0.33), n)
    assert "not measurably better than one" in verdict(res(0.2, 0.30, 0.29), n)
    assert "partly agrees" in verdict(res(0.2, 0.21, 0.3), n)
    assert "contradicts" in verdict(res(0.3, 0.2, 0.31), n)
    assert "within two standard errors" in verdict(res(0.3, 0.31, 0.32), n)
    assert verdict(res(0.07, 0.075, 0.072), n).startswith("Inconclusive")  # all near chance (6.25%)
    assert verdict(res(0.09, 0.095, 0.1), n, chance=0.085).startswith("Inconclusive")  # near the majority baseline


@pytest.mark.slow  # six short training runs: ~15 s on a quiet 2-core machine
def test_micro_run_writes_a_reproducible_report(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENK2_EXPERIMENT_MICRO", "1")
    assert EXPERIMENTS["rephrase-vs-repeat"] == "openk2.experiments.rephrase_vs_repeat"
    runs, threads = [], torch.get_num_threads()
    try:  # one thread: several times faster when other jobs share the cores
        for name in ("a", "b"):
            argv = ["rephrase-vs-repeat", "--quick", "--seed", "5", "--threads", "1", "--out-dir", str(tmp_path / name)]
            assert experiment_main(argv) == 0
            runs.append(json.loads((tmp_path / name / "results.json").read_text()))
    finally:
        torch.set_num_threads(threads)
    report = (tmp_path / "a" / "report.md").read_text()
    for section in ("Setup", "Results", "Conclusion", "Plots", "Reproduce"):
        assert f"## {section}" in report
    assert "openk2 experiment rephrase-vs-repeat --quick --seed 5" in report
    assert (tmp_path / "a" / "qa_accuracy.png").stat().st_size > 1000
    arms = runs[0]["arms"]
    assert set(arms) == {"raw-x10", "rephrase1-x10", "rephrase10-x1"}
    assert len({a["tokens_seen"] for a in arms.values()}) == 1  # equal tokens in every arm
    assert arms["raw-x10"]["epochs"] == pytest.approx(10, rel=0.1)
    for arm in arms:  # same seed, same numbers
        assert runs[1]["arms"][arm]["qa_accuracy"] == arms[arm]["qa_accuracy"]
        assert runs[1]["arms"][arm]["val_loss"] == arms[arm]["val_loss"]
