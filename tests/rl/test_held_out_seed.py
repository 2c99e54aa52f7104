"""`task.eval_seed`: RL runs of several seeds can share one held-out set (and the pipeline's SFT data avoids it)."""

from pathlib import Path

import pytest

from openk2.data.conversations import read_conversations
from openk2.pipeline.task_data import write_task_conversations
from openk2.rl import tasks
from openk2.rl.config import load_rl_config
from openk2.rl.mixture import build_mixture, held_out_problems

RL_TINY = Path(__file__).resolve().parents[2] / "configs" / "rl-tiny.toml"


def _held_out(*overrides: str) -> list[str]:
    (env,) = build_mixture(load_rl_config(RL_TINY, ["task.eval_problems=50", *overrides]), 0)
    return [p.prompt for p in env.eval_problems]


def test_default_follows_the_run_seed_and_a_fixed_eval_seed_does_not():
    assert _held_out() == _held_out("task.eval_seed=0")  # -1 (default) means train.seed, here 0
    assert _held_out("train.seed=1") != _held_out()  # the old coupling, kept as the default
    fixed = _held_out("task.eval_seed=0")
    assert _held_out("train.seed=1", "task.eval_seed=0") == fixed
    assert _held_out("train.seed=2", "task.eval_seed=0") == fixed


def test_training_stream_and_sft_task_data_exclude_the_fixed_set(tmp_path):
    cfg = load_rl_config(RL_TINY, ["train.seed=2", "task.eval_seed=0", "task.eval_problems=300"])
    (env,) = build_mixture(cfg, cfg.train.seed)
    held = {p.prompt for p in held_out_problems(tasks.get("arithmetic"), [3], 300, 0)}
    assert env.exclude == held
    assert all(env.draw(seed, 0).prompt not in held for seed in range(2000))
    rows = read_conversations(write_task_conversations(tmp_path / "t.jsonl", cfg, 2000))
    assert not {row["messages"][0]["content"] for row in rows} & held


def test_bad_eval_seed_is_a_value_error():
    with pytest.raises(ValueError, match="task.eval_seed"):
        load_rl_config(RL_TINY, ["task.eval_seed=-2"])
