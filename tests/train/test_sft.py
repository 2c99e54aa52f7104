"""`openk2 sft` end to end on a micro model: weights from the init checkpoint, learning, before/after tool-call
scores, exact resume; init_from resolution; the well-formed tool-call check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomli_w
import torch

from openk2.chat.template import render
from openk2.cli import main as cli_main
from openk2.cli.sft import sft_main
from openk2.config import ModelConfig
from openk2.data import toolchat
from openk2.data.tokenizer import train_tokenizer
from openk2.model import K2ForCausalLM
from openk2.train.checkpoint import CheckpointManager
from openk2.train.config import load_run_config
from openk2.train.metrics import read_metrics
from openk2.train.sft import EVAL_FILE, SFTTrainer, resolve_init_checkpoint, sft_run_config
from openk2.train.toolcall_eval import score_response

MICRO = dict(vocab_size=640, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
             v_head_dim=8, n_routed_experts=8)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A 'pre-training run' directory whose one complete checkpoint holds a random micro model and its tokenizer."""
    run = tmp_path_factory.mktemp("base")
    texts = [render(c["messages"], c.get("tools"), add_generation_prompt=False) for c in toolchat.generate(300, 9)]
    tokenizer = train_tokenizer(texts, MICRO["vocab_size"])
    torch.manual_seed(0)
    model = K2ForCausalLM(ModelConfig.preset("tiny").replace(**MICRO))

    def write(path: Path) -> None:
        model.save_pretrained(path)
        tokenizer.save(path)

    CheckpointManager(run / "checkpoints").save(10, write)
    return run


def _config(tmp_path: Path, base_run: Path) -> Path:
    raw = {
        "optim": {"lr": 1e-2, "ns_dtype": "float32"},
        "schedule": {"warmup_steps": 1, "decay_fraction": 0.25},
        "train": {"steps": 6, "batch_size": 2, "precision": "fp32", "log_every": 1, "eval_every": 3,
                  "eval_batches": 2, "checkpoint_every": 3, "threads": 1},
        "sft": {"init_from": str(base_run), "generate": 40, "seq_len": 256, "eval_prompts": 4, "eval_max_tokens": 8,
                "perplexity_windows": 8},
        # the corpus whose perplexity is measured before and after (unasserted here): 400 math documents, not the
        # default mixture, which took ~2/3 of each run to tokenise
        "data": {"val_fraction": 0.1, "sources": [{"kind": "math", "weight": 1.0, "num_docs": 400}]},
    }
    path = tmp_path / "sft.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.slow
def test_sft_runs_end_to_end_and_resumes_exactly(tmp_path, base_run, capsys):
    config = str(_config(tmp_path, base_run))
    straight = tmp_path / "straight"
    assert sft_main(["--config", config, "--out", str(straight)]) == 0
    printed = capsys.readouterr().out
    assert "tool calls before:" in printed and "tool calls after:" in printed
    losses = _losses(straight)
    assert sorted(losses) == list(range(1, 7))
    assert losses[6] < losses[1]  # it learns the assistant turns
    assert any("val_loss" in r for r in read_metrics(straight))
    scores = json.loads((straight / EVAL_FILE).read_text())
    assert scores["before"]["prompts"] == scores["after"]["prompts"] == 4 and scores["after_step"] == 6
    K2ForCausalLM.from_pretrained(straight / "checkpoints" / "step-0000006")  # an HF-layout checkpoint

    interrupted = tmp_path / "interrupted"
    assert sft_main(["--config", config, "--out", str(interrupted), "--max-steps", "3"]) == 0
    assert sft_main(["--config", config, "--out", str(interrupted), "--resume"]) == 0
    assert _losses(interrupted) == losses  # bit-identical per-step losses in fp32
    resumed_scores = json.loads((interrupted / EVAL_FILE).read_text())
    assert resumed_scores["before"] == scores["before"]  # measured once, on the base model, kept across resume


def test_training_starts_from_the_init_checkpoint(tmp_path, base_run):
    cfg, init = sft_run_config(load_run_config(_config(tmp_path, base_run)))
    assert init == base_run / "checkpoints" / "step-0000010"
    assert cfg.model.hidden_size == MICRO["hidden_size"]  # the checkpoint's model, not the [model] preset
    trainer = SFTTrainer(cfg, init, out_dir=tmp_path / "run")
    base = K2ForCausalLM.from_pretrained(init, dtype=torch.float32).state_dict()
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(tensor, base[name], rtol=0, atol=0)
    batch = next(trainer.train_loader)
    assert set(batch) == {"input_ids", "labels", "position_ids", "segment_ids"}
    assert trainer.tokenizer.vocab_size == MICRO["vocab_size"]


def test_init_from_must_name_a_model(tmp_path, base_run, capsys):
    with pytest.raises(ValueError, match="not set"):
        resolve_init_checkpoint(None)
    with pytest.raises(ValueError, match="not a directory"):
        resolve_init_checkpoint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no complete checkpoint"):
        resolve_init_checkpoint(tmp_path / "empty")
    checkpoint = base_run / "checkpoints" / "step-0000010"
    assert resolve_init_checkpoint(checkpoint) == checkpoint
    no_sft = tmp_path / "pretrain.toml"
    no_sft.write_text("[train]\nsteps = 3\n")
    assert cli_main(["sft", "--config", str(no_sft)]) == 2
    assert "no [sft] table" in capsys.readouterr().err
    (tmp_path / "nodata.toml").write_text(f'[sft]\ninit_from = "{base_run}"\n')
    assert cli_main(["sft", "--config", str(tmp_path / "nodata.toml")]) == 2
    assert "needs training data" in capsys.readouterr().err


def _call(name: str, arguments: str) -> str:
    return (f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>"
            f"{arguments}<|tool_call_end|><|tool_calls_section_end|><|im_end|>")


def test_well_formed_means_declared_tool_json_object_and_required_keys():
    tools = [toolchat.TOOLS["get_weather"], toolchat.TOOLS["calculate"]]
    expected = {"name": "get_weather", "arguments": {"city": "Riga"}}
    good = score_response(_call("get_weather", '{"city": "Riga"}'), tools, expected)
    assert good == {"any_call": True, "well_formed": True, "correct_tool": True, "exact_arguments": True}
    wrong_value = score_response(_call("get_weather", '{"city": "Oslo"}'), tools, expected)
    assert wrong_value["well_formed"] and wrong_value["correct_tool"] and not wrong_value["exact_arguments"]
    assert score_response(_call("calculate", '{"expression": "1 + 2"}'), tools, expected)["correct_tool"] is False
    for bad in (_call("get_time", '{"timezone": "UTC"}'),  # not declared
                _call("get_weather", '{"unit": "celsius"}'),  # required key missing
                _call("get_weather", '{"city": "Riga"'),  # not JSON
                _call("get_weather", '["Riga"]')):  # not an object
        flags = score_response(bad, tools, expected)
        assert flags["any_call"] and not flags["well_formed"]
    assert score_response("It is sunny.<|im_end|>", tools, expected) == dict.fromkeys(
        ("any_call", "well_formed", "correct_tool", "exact_arguments"), False)
