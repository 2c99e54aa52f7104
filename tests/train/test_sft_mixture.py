"""The SFT mixture: the exact pre-training share, pre-training rows trained on every token, resumable mixed
batches; synthesized trajectories read defensively, split by task, turned into held-out tool-call prompts;
`openk2 sft` end to end on all three sources with perplexity before/after and an exact resume."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import tomli_w
import torch

from openk2.cli.sft import sft_main
from openk2.data import toolchat
from openk2.data.conversations import ConversationLoader, tokenize_conversations
from openk2.data.corpus import CorpusConfig
from openk2.data.packing import IGNORE_INDEX
from openk2.data.tokenizer import K2Tokenizer
from openk2.train.config import RunConfig
from openk2.train.metrics import read_metrics
from openk2.train.sft import EVAL_FILE, SFTTrainer, sft_run_config
from openk2.train.sft_mixture import (
    MixedLoader,
    is_heldout,
    is_pretrain_row,
    k2_call_ids,
    pretrain_loader,
    read_synthesized,
    tool_call_prompts,
)
from tests.train.conftest import MICRO_DATA
from tests.train.test_sft import base_run  # noqa: F401  (a fixture: a random micro model and its tokenizer)

SEQ_LEN = 256


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.2, 1 / 3, 0.9])
def test_pretrain_share_is_exact_at_every_prefix(fraction):
    count = 0
    for n in range(1, 2001):
        count += is_pretrain_row(n - 1, fraction)
        assert count == math.floor(n * fraction)


def _synth_line(task: str, city: str, arguments: str | None = None) -> dict:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments or json.dumps({"city": city})}}
    return {"messages": [{"role": "user", "content": f"Weather in {city}?"},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 3}'},
                         {"role": "assistant", "content": f"3 degrees in {city}."}],
            "tools": [toolchat.TOOLS["get_weather"]], "meta": {"task_id": task, "judge_score": 1.0}}


def _write_synth(directory: Path, tasks: int = 40, samples: int = 2) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(_synth_line(f"a{t:03d}-t0", f"City{t}")) for t in range(tasks) for _ in range(samples)]
    (directory / "sft.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def test_synthesized_data_is_split_by_task_and_hostile_lines_are_skipped(tmp_path):
    run = _write_synth(tmp_path / "synth")
    hostile = ["{not json", "[1, 2]", json.dumps({"messages": "hi"}),
               json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
               json.dumps({"messages": [{"role": "assistant", "content": 5}], "tools": "x"}),
               "[" * 100_000 + "]" * 100_000]
    with open(run / "sft.jsonl", "a") as f:
        f.write("\n".join(hostile) + "\n")
    data = read_synthesized([run], heldout_fraction=0.25, seed=0)
    assert len(data.train) + len(data.heldout) == 80 and sum(data.skipped.values()) == len(hostile)
    assert data.skipped["not JSON"] == 2 and 0 < len(data.heldout) < 40
    assert all(set(c) == {"messages", "tools"} for c in data.train + data.heldout)  # meta dropped
    held = {c["messages"][0]["content"] for c in data.heldout}
    assert not held & {c["messages"][0]["content"] for c in data.train}  # a task's samples stay on one side
    assert all(is_heldout(f"a{t:03d}-t0", 0.25, 0) == (f"Weather in City{t}?" in held) for t in range(40))
    assert read_synthesized([run / "sft.jsonl"], 0.25, seed=0).heldout == data.heldout  # a file works too
    with pytest.raises(ValueError, match="no sft.jsonl"):
        read_synthesized([tmp_path / "missing"], 0.1)


def test_heldout_prompts_end_before_the_first_call():
    conversations = [_synth_line("t", "Riga"), _synth_line("u", "Oslo", arguments="{broken"),
                     {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    prompts = tool_call_prompts(conversations)
    assert len(prompts) == 1
    assert prompts[0]["messages"] == conversations[0]["messages"][:1]
    assert prompts[0]["expected"] == {"name": "get_weather", "arguments": {"city": "Riga"}}


def _mixed(tokenizer: K2Tokenizer, tmp_path: Path, fraction: float, batch_size: int = 4) -> MixedLoader:
    data = tokenize_conversations(toolchat.generate(30, 1), tokenizer, SEQ_LEN)
    conversations = ConversationLoader(data, batch_size, SEQ_LEN, tokenizer.pad_id, seed=3)
    corpus = CorpusConfig.from_dict({**copy.deepcopy(MICRO_DATA), "cache_dir": str(tmp_path / "cache")})
    return MixedLoader(conversations, pretrain_loader(corpus, tokenizer, SEQ_LEN), fraction, batch_size)


def test_mixed_batches_carry_pretraining_rows_with_loss_on_every_token(tmp_path, base_run):  # noqa: F811
    tokenizer = K2Tokenizer.load(base_run / "checkpoints" / "step-0000010")
    loader = _mixed(tokenizer, tmp_path, 0.25)
    batches = [next(loader) for _ in range(3)]
    rows = [(b, r) for b in batches for r in range(4)]
    for k, (batch, r) in enumerate(rows):
        labelled = batch["labels"][r] != IGNORE_INDEX
        if is_pretrain_row(k, 0.25):  # rows 3, 7, 11: one window of corpus text, all of it trained on
            assert (batch["segment_ids"][r] == 0).all()
            assert torch.equal(batch["position_ids"][r], torch.arange(SEQ_LEN))
            assert labelled.float().mean() > 0.9  # only each document's first token is not a target
        else:  # conversations: loss on assistant tokens only
            assert labelled.float().mean() < 0.6 and (batch["segment_ids"][r] >= -1).all()
    assert loader.rows == 12 and loader.pretrain_rows() == 3
    assert loader.labels["pretrain"] > 0 and loader.labels["sft"] > 0

    resumed = _mixed(tokenizer, tmp_path, 0.25)
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    for _ in range(3):
        expected, got = next(loader), next(resumed)
        assert all(torch.equal(expected[key], got[key]) for key in expected)
    with pytest.raises(ValueError, match="pretrain_fraction"):
        _mixed(tokenizer, tmp_path, 0.05).load_state_dict(loader.state_dict())
    without = _mixed(tokenizer, tmp_path, 0.0)
    for _ in range(3):  # no pre-training row at all: every row is conversations, mostly context
        assert ((next(without)["labels"] != IGNORE_INDEX).float().mean(dim=1) < 0.6).all()


def test_config_keys_are_validated():
    base = {"init_from": "x", "generate": 10}
    for key, value, message in (("pretrain_fraction", 1.0, "pretrain_fraction"),
                                ("synth_heldout", -0.1, "synth_heldout"), ("perplexity_windows", -1, "non-negative"),
                                ("pretrain_fraction", "0.1", "must be"), ("synth_file", [], "unknown")):
        with pytest.raises(ValueError, match=message):
            RunConfig.from_dict({"sft": {**base, key: value}})
    assert RunConfig.from_dict({"sft": {"init_from": "x", "synth_files": ["runs/synth"]}}).sft.synth_files


@pytest.mark.slow
def test_sft_on_the_full_mixture_measures_forgetting_and_resumes_exactly(tmp_path, base_run):  # noqa: F811
    raw = {
        "data": {**copy.deepcopy(MICRO_DATA), "cache_dir": str(tmp_path / "cache")},
        "optim": {"lr": 1e-2, "ns_dtype": "float32"},
        "schedule": {"warmup_steps": 1, "decay_fraction": 0.25},
        "train": {"steps": 4, "batch_size": 2, "precision": "fp32", "log_every": 1, "eval_every": 2,
                  "eval_batches": 1, "checkpoint_every": 2, "threads": 1},
        "sft": {"init_from": str(base_run), "generate": 20, "seq_len": SEQ_LEN, "eval_prompts": 2,
                "eval_max_tokens": 4, "synth_files": [str(_write_synth(tmp_path / "synth", tasks=20, samples=1))],
                "synth_heldout": 0.3, "synth_eval_prompts": 3, "pretrain_fraction": 0.25, "perplexity_windows": 4},
    }
    config = tmp_path / "sft.toml"
    config.write_text(tomli_w.dumps(raw))
    straight = tmp_path / "straight"
    assert sft_main(["--config", str(config), "--out", str(straight)]) == 0
    record = json.loads((straight / EVAL_FILE).read_text())
    assert record["synth_before"]["prompts"] == record["synth_after"]["prompts"] == 3
    assert record["after"]["prompt_tokens_max"] > 0
    assert math.isfinite(record["perplexity_before"]) and record["perplexity_before"] > 1
    assert record["perplexity_factor"] == pytest.approx(record["perplexity_after"] / record["perplexity_before"])
    mixture = record["mixture"]
    assert mixture["rows"] == 8 and mixture["pretrain_rows"] == 2 and 0 < mixture["pretrain_label_share"] < 1

    interrupted = tmp_path / "interrupted"
    assert sft_main(["--config", str(config), "--out", str(interrupted), "--max-steps", "2"]) == 0
    assert sft_main(["--config", str(config), "--out", str(interrupted), "--resume"]) == 0
    losses = {r["step"]: r["loss"] for r in read_metrics(straight) if "loss" in r}
    assert {r["step"]: r["loss"] for r in read_metrics(interrupted) if "loss" in r} == losses
    resumed = json.loads((interrupted / EVAL_FILE).read_text())
    assert resumed["mixture"] == mixture and resumed["perplexity_before"] == record["perplexity_before"]


def test_call_ids_become_k2_ids_and_tool_results_follow():
    line = _synth_line("t", "Riga")
    line["messages"] += [{"role": "user", "content": "And Oslo?"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": "call_9", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                         {"role": "tool", "tool_call_id": "call_9", "content": "{}"}]
    messages = k2_call_ids(line["messages"])
    ids = [c["id"] for m in messages for c in m.get("tool_calls") or []]
    assert ids == ["functions.get_weather:0", "functions.get_weather:1"]
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == ids
    assert line["messages"][1]["tool_calls"][0]["id"] == "call_1"  # the input is not modified


def test_a_step_with_pretraining_rows_is_not_a_loss_spike(tmp_path, base_run):  # noqa: F811
    cfg = RunConfig.from_dict({
        "data": {**copy.deepcopy(MICRO_DATA), "cache_dir": str(tmp_path / "cache")},
        "train": {"batch_size": 2, "spike_factor": 2.0, "threads": 1},
        "schedule": {"warmup_steps": 0},
        "sft": {"init_from": str(base_run), "generate": 60, "seq_len": 512, "pretrain_fraction": 0.25},
    })
    cfg, init = sft_run_config(cfg)
    trainer = SFTTrainer(cfg, init, out_dir=tmp_path / "run")
    trainer.step, trainer.loss_ema = 5, 1.0
    next(trainer.train_loader)  # rows 0-1: conversations only
    assert "loss spike" in trainer._bad_loss(3.0)
    next(trainer.train_loader)  # rows 2-3: row 3 is corpus text
    assert trainer._bad_loss(3.0) is None and "non-finite" in trainer._bad_loss(float("nan"))
