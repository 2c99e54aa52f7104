"""`openk2 rl` with a multi-turn tool environment in the mixture, end to end on a micro config: the warm-up
writes tool transcripts, episodes run real engine turns with executed calls, per-environment tool metrics and
held-out evaluation are logged, and a resumed run continues."""

import json
from pathlib import Path

import pytest

from openk2.rl.config import load_rl_config
from openk2.rl.tool_probe import probe_problems
from openk2.rl.trainer import RLTrainer
from openk2.train.metrics import read_metrics

TOOLS = Path(__file__).resolve().parents[2] / "configs" / "rl-tools-tiny.toml"
MIXTURE = """
[[envs]]
name = "arithmetic"
difficulties = [1]
max_tokens = 12

[[envs]]
name = "lookup"
difficulties = [1, 2]
max_tokens = 40
max_turns = 3
eval_problems = 4
"""


def test_shipped_config_selects_the_tool_environment(tmp_path):
    cfg = load_rl_config(TOOLS)
    (env,) = cfg.environments()
    assert (env.task_name, env.max_turns) == ("lookup", 3)
    bad = tmp_path / "bad.toml"
    bad.write_text(f'base = "{TOOLS.as_posix()}"\n[[envs]]\nname = "lookup"\nmax_turns = -1\n')
    with pytest.raises(ValueError, match="max_turns"):
        load_rl_config(bad)


@pytest.mark.slow
def test_tool_environment_trains_evaluates_and_resumes(micro_rl_run):
    run = micro_rl_run(TOOLS, MIXTURE, ["task.eval_samples=1", "model.max_position_embeddings=320",
                                        "warmup.probe_problems=2"])
    out = run.out
    records = run.cli(max_iterations=2)
    assert [r["step"] for r in records] == [0, 1, 2]
    probe = json.loads((out / "warmup" / "probe.json").read_text())  # the adaptive stop checked at the cap, 10
    assert probe["checks"][-1]["step"] == probe["steps"] <= 10
    for key in ("eval_reward/lookup", "eval_reward_sampled/lookup", "eval_reward/arithmetic"):
        assert 0.0 <= records[0][key] <= 1.0, key
    trained = [r for r in records[1:] if r.get("groups_trained/lookup")]
    assert trained  # MICRO draws 3 groups per iteration from the two environments
    for r in trained:
        assert r["tool_calls/lookup"] >= 0 and 1 <= r["turns/lookup"] <= 3
        assert "malformed_rate/lookup" in r and 0 < r["response_len/lookup"] <= 40
    # (10 micro warm-up steps do not teach the call format: tests/rl/test_tool_episode.py scripts the calls)

    cfg = load_rl_config(run.config, run.overrides)
    trainer = RLTrainer(cfg, out, resume=True)
    probes = probe_problems(trainer.env_by_name["lookup"], 2, cfg.train.seed)
    assert {p.prompt for p in probes} <= trainer.env_by_name["lookup"].exclude  # resumed: still never trained on
    assert trainer.iteration == 2 and all(g.env != "lookup" for g in trainer.rollout.paused)  # never paused
    summary = trainer.run(max_iterations=1)
    assert summary.iteration == 3
    assert [r["step"] for r in read_metrics(out)] == [0, 1, 2, 3]
