"""`openk2 pipeline` end to end on a micro model: every stage runs for real (tokenizer training, MuonClip
pre-training, SFT, RL, the evaluation harness on a local checkpoint), then skip, --force, crash and resume."""

from __future__ import annotations

import json
import re
import shutil
import time
import tomllib
from pathlib import Path

import pytest

from openk2.cli import main as cli_main
from openk2.cli.pipeline import pipeline_main
from openk2.data.conversations import read_conversations
from openk2.pipeline import toml_writer
from openk2.pipeline.config import load_pipeline_config
from openk2.pipeline.runner import LOG_FILE, run_pipeline
from openk2.pipeline.stages import DONE_FILE, build_stages, downstream
from openk2.pipeline.task_data import write_task_conversations
from openk2.rl import tasks
from openk2.rl.config import RLConfig, load_rl_config
from openk2.rl.mixture import build_mixture
from openk2.rl.tasks.base import extract_answer
from openk2.rl.tasks.expr import evaluate
from openk2.rl.trainer import RLTrainer, held_out_problems

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STAGES = ["tokenizer", "pretrain", "eval-pretrain", "sft", "eval-sft", "rl", "eval-rl"]


def micro_config(tmp_path: Path, **extra: str) -> Path:
    """A pipeline file over the shipped stage configs, shrunk to seconds per stage."""
    text = f"""
out_dir = "{tmp_path / 'run'}"

[tokenizer]
vocab_size = 600
train_chars = {extra.get('train_chars', '60000')}

[pretrain]
config = "{CONFIGS / 'tiny.toml'}"

[pretrain.set]
model.hidden_size = 64
model.intermediate_size = 128
model.moe_intermediate_size = 32
model.num_hidden_layers = 2
model.num_attention_heads = 2
model.q_lora_rank = 32
model.kv_lora_rank = 16
model.qk_nope_head_dim = 16
model.qk_rope_head_dim = 8
model.v_head_dim = 16
model.n_routed_experts = 4
model.num_experts_per_tok = 2
model.max_position_embeddings = 512
data.seq_len = 64
data.cache_dir = "{tmp_path / 'cache'}"
data.sources = [{{kind = "math", num_docs = 200}}, {{kind = "shakespeare", max_chars = 60000}}]
train.steps = 4
train.batch_size = 4
train.log_every = 2
train.eval_every = 2
train.eval_batches = 1
train.checkpoint_every = 2
schedule.warmup_steps = 1

[sft]
config = "{CONFIGS / 'sft-tiny.toml'}"
task_examples = 30

[sft.set]
sft.generate = 30
sft.eval_prompts = 2
sft.eval_max_tokens = 8
sft.seq_len = 384
train.steps = 3
train.batch_size = 2
train.log_every = 1
train.eval_every = 3
train.eval_batches = 1
train.checkpoint_every = 3
schedule.warmup_steps = 1

[rl]
config = "{CONFIGS / 'rl-tiny.toml'}"

[rl.set]
task.eval_problems = 3
task.eval_samples = 1
rollout.prompts_per_iteration = 2
rollout.samples_per_prompt = 2
rollout.max_tokens = 8
rollout.segment_tokens = 0
train.iterations = 2
train.eval_every = 2
train.checkpoint_every = 1

[eval]
benchmarks = ["rl:arithmetic"]
limit = 3
max_tokens = 8
"""
    path = tmp_path / "micro.toml"
    path.write_text(text)
    return path


def manifests(out: Path) -> dict[str, str]:
    return {name: (out / name / DONE_FILE).read_text() for name in STAGES if (out / name / DONE_FILE).is_file()}


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_pipeline_runs_skips_forces_and_resumes(tmp_path, monkeypatch, capsys):
    config = micro_config(tmp_path)
    out = tmp_path / "run"

    # 1. everything runs, in order, and leaves its outputs
    result = run_pipeline(load_pipeline_config(config))
    assert [(o.name, o.status) for o in result.outcomes] == [(name, "ran") for name in STAGES]
    for path in ["tokenizer/tokenizer.json", "pretrain/stage.toml", "pretrain/checkpoints/step-0000004/config.json",
                 "pretrain/loss.png", "pretrain/max_logit.png", "sft/task_train.jsonl", "sft/toolcall_eval.json",
                 "sft/checkpoints/step-0000003/model.safetensors", "rl/checkpoints/step-0000002/rl_state.json",
                 "rl/rl_curves.png", "eval-pretrain/results.json", "eval-sft/rl:arithmetic/samples.jsonl",
                 "eval-rl/results.json", "report.md", "eval_stages.png"]:
        assert (out / path).is_file(), path
    assert tomllib.loads((out / "pretrain" / "stage.toml").read_text())["model"]["vocab_size"] == 600
    report = (out / "report.md").read_text()
    for name in STAGES:  # each stage's row carries its wall and CPU seconds
        assert re.search(rf"^\| {re.escape(name)} \| \d+\.\d \| \d+\.\d \| [\d.-]+ \| 1 \|", report, re.M), name
    assert re.search(r"^\| pretrain .*val \d+\.\d{3} \(unigram \d+\.\d{3}\)", report, re.M)
    assert re.search(r"held-out reward greedy \d\.\d{3} -> \d\.\d{3}", report)
    row = next(line for line in report.splitlines() if line.startswith("| rl:arithmetic |"))
    assert len(re.findall(r"\d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] \(n=3\)", row)) == 3  # after pretrain, SFT, RL
    first = manifests(out)
    assert set(first) == set(STAGES)

    # 2. a second invocation skips every stage and reruns nothing
    start = time.perf_counter()
    assert pipeline_main(["--config", str(config)]) == 0
    assert time.perf_counter() - start < 15
    assert manifests(out) == first
    log = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]
    assert [r["status"] for r in log[-len(STAGES):]] == ["skipped"] * len(STAGES)

    # 3. --force sft redoes SFT and everything downstream; RL is killed after its first checkpoint
    def crash_at_second_iteration(self):
        if self.iteration == 1:
            raise RuntimeError("simulated crash in the RL stage")
        return original_iterate(self)

    original_iterate = RLTrainer.iterate
    monkeypatch.setattr(RLTrainer, "iterate", crash_at_second_iteration)
    with pytest.raises(RuntimeError, match="simulated crash"):
        pipeline_main(["--config", str(config), "--force", "sft"])
    second = manifests(out)
    for name in ("tokenizer", "pretrain", "eval-pretrain"):
        assert second[name] == first[name], f"{name} must not rerun"
    for name in ("sft", "eval-sft"):
        assert second[name] != first[name], f"{name} must rerun"
    assert "rl" not in second and "eval-rl" not in second
    assert (out / "rl" / "checkpoints" / "step-0000001").is_dir()
    assert json.loads((out / LOG_FILE).read_text().splitlines()[-1])["status"] == "failed"

    # 4. the next invocation skips the finished stages and resumes RL from its checkpoint
    monkeypatch.setattr(RLTrainer, "iterate", original_iterate)
    result = run_pipeline(load_pipeline_config(config))
    statuses = {o.name: o.status for o in result.outcomes}
    assert statuses == {**{n: "skipped" for n in STAGES[:5]}, "rl": "ran", "eval-rl": "ran"}
    rl_done = json.loads((out / "rl" / DONE_FILE).read_text())
    assert rl_done["info"]["resumed_from"] == "step-0000001"
    steps = [json.loads(line)["step"] for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]  # no iteration lost or repeated
    report = (out / "report.md").read_text()
    assert re.search(r"^\| rl \|.* \| 2, resumed from step-0000001 \| 2 iterations;", report, re.M)
    assert re.search(r"^\| sft \|.* \| 1 \| 3 steps;", report, re.M)  # a forced rerun is one attempt

    # 5. a moved pipeline directory is still done (fingerprints hold no paths)
    shutil.copytree(out, tmp_path / "moved")
    result = run_pipeline(load_pipeline_config(config), out_dir=tmp_path / "moved")
    assert all(o.status == "skipped" for o in result.outcomes)

    # 6. a finished stage whose config changed is an error, not a silent reuse
    changed = micro_config(tmp_path, train_chars="50000")
    with pytest.raises(ValueError, match="--force tokenizer"):
        run_pipeline(load_pipeline_config(changed))


# ------------------------------------------------------------------------------------------------ config
def test_bad_configs_are_one_line_errors(tmp_path, capsys):
    good = micro_config(tmp_path).read_text()
    cases = {
        "unknown_key": ("colour = 'red'\n" + good, "unknown pipeline key"),
        "owned_key": (good.replace("[sft.set]\n", "[sft.set]\nsft.init_from = 'elsewhere'\n"), "pipeline sets it"),
        "missing_file": (good.replace(str(CONFIGS / "rl-tiny.toml"), "nope.toml"), "not found"),
        "bad_stage_key": (good.replace("task.eval_samples = 1", "task.eval_sample = 1"), "unknown key"),
        "bad_after": (good.replace('limit = 3', 'limit = 3\nafter = ["warmup"]'), "eval.after"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            build_stages(load_pipeline_config(path), tmp_path / "out")
        assert cli_main(["pipeline", "--config", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("openk2 pipeline: error:"), (name, err)
    with pytest.raises(ValueError, match="unknown stage"):
        run_pipeline(load_pipeline_config(micro_config(tmp_path)), force=["warmup"])
    assert not (tmp_path / "run").exists()  # nothing ran


def test_set_flags_reach_the_stage_configs(tmp_path):
    cfg = load_pipeline_config(micro_config(tmp_path), ["pretrain.set.train.steps=9", "threads=1"])
    assert cfg.stage_raw("pretrain")["train"]["steps"] == 9 and cfg.threads == 1
    shipped = load_pipeline_config(CONFIGS / "pipeline-tiny.toml")
    assert [s.name for s in build_stages(shipped, tmp_path)] == STAGES


def test_force_covers_everything_downstream(tmp_path):
    stages = build_stages(load_pipeline_config(micro_config(tmp_path)), tmp_path / "run")
    assert downstream(stages, {"sft"}) == {"sft", "eval-sft", "rl", "eval-rl"}
    assert downstream(stages, {"tokenizer"}) == set(STAGES)
    assert downstream(stages, {"eval-pretrain"}) == {"eval-pretrain"}


def test_stage_config_round_trips_through_toml(tmp_path):
    cfg = load_pipeline_config(micro_config(tmp_path))
    for name in ("pretrain", "sft", "rl"):
        raw = cfg.stage_raw(name)
        assert tomllib.loads(toml_writer.dumps(raw)) == raw
    odd = {"a b": "quote \" and \\ and \n", "x": {"y": [1, 2.5, True], "z": {"w": -3}}, "t": [{"k": "v"}]}
    assert tomllib.loads(toml_writer.dumps(odd)) == odd


def test_task_conversations_are_correct_and_avoid_the_held_out_set(tmp_path):
    rl = load_rl_config(CONFIGS / "rl-tiny.toml")
    path = write_task_conversations(tmp_path / "task.jsonl", rl, 200)
    conversations = read_conversations(path)  # validates the chat structure
    assert len(conversations) == 200
    task = tasks.get("arithmetic")
    held_out = {p.prompt for p in held_out_problems(task, rl.task.difficulties, rl.task.eval_problems, rl.train.seed)}
    for conversation in conversations:
        user, assistant = conversation["messages"]
        assert user["content"] not in held_out
        expression = re.search(r"Compute (\S+)\.", user["content"]).group(1)
        value, _ = evaluate(expression)
        assert extract_answer(assistant["content"]) == str(int(value))
    with pytest.raises(ValueError, match="only the arithmetic task"):
        write_task_conversations(tmp_path / "x.jsonl", load_rl_config(None, ["task.name=math"]), 3)


def test_shipped_rl_stage_keeps_its_held_out_set_across_seeds(tmp_path):
    """RL seeds rerun from one SFT checkpoint (`--set train.seed=N`) are scored on the problems the SFT data
    excludes: the shipped stage fixes `task.eval_seed`, so the draw does not follow `train.seed`."""
    shipped = load_pipeline_config(CONFIGS / "pipeline-tiny.toml")
    rl = RLConfig.from_dict(shipped.stage_raw("rl"))
    task = tasks.get("arithmetic")
    sft_rows = read_conversations(write_task_conversations(tmp_path / "t.jsonl", rl, shipped.sft.task_examples))
    sft_prompts = {row["messages"][0]["content"] for row in sft_rows}
    for seed in (0, 1, 2):
        (env,) = build_mixture(RLConfig.from_dict({**shipped.stage_raw("rl"), "train": {"seed": seed}}), seed)
        held = [p.prompt for p in env.eval_problems]
        assert held == [p.prompt for p in held_out_problems(task, [3], rl.task.eval_problems, 0)]
        assert not set(held) & sft_prompts
