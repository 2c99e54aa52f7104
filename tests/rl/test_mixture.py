"""The environment mixture: [[envs]] parsing, weighted draws, the difficulty curriculum, per-env budgets and
metrics in one micro `openk2 rl` run."""

import collections

import pytest

from openk2.rl.config import EnvSection, load_rl_config
from openk2.rl.mixture import build_mixture, choose_env
from openk2.rl.trainer import RLTrainer
from openk2.train.metrics import read_metrics
from tests.rl.test_trainer import CONFIG, MICRO

TWO_ENVS = """base = "{base}"

[[envs]]
name = "sums"
task = "arithmetic"
weight = 3.0
difficulties = [1, 2]
max_tokens = 10
curriculum_iterations = 4

[[envs]]
name = "morse"
weight = 1.0
difficulties = [1]
eval_problems = 4
"""



def _two_env_config(tmp_path, extra=()):
    path = tmp_path / "mix.toml"
    path.write_text(TWO_ENVS.format(base=CONFIG.as_posix()))
    return load_rl_config(path, [*MICRO, *extra])


def test_envs_parse_and_reject_bad_entries(tmp_path):
    cfg = _two_env_config(tmp_path)
    assert [e.name for e in cfg.environments()] == ["sums", "morse"]
    assert cfg.environments()[0].task_name == "arithmetic" and cfg.environments()[1].task_name == "morse"
    assert load_rl_config(CONFIG).environments()[0].difficulties == [3]  # no [[envs]]: the [task] table
    (tmp_path / "bad.toml").write_text(f'base = "{CONFIG.as_posix()}"\n[[envs]]\nname = "a"\nweight = 0.0\n')
    with pytest.raises(ValueError, match="weight"):
        load_rl_config(tmp_path / "bad.toml")
    (tmp_path / "dup.toml").write_text(f'base = "{CONFIG.as_posix()}"\n[[envs]]\nname = "a"\n[[envs]]\nname = "a"\n')
    with pytest.raises(ValueError, match="unique"):
        load_rl_config(tmp_path / "dup.toml")
    (tmp_path / "key.toml").write_text(f'base = "{CONFIG.as_posix()}"\n[[envs]]\nname = "a"\nwieght = 1.0\n')
    with pytest.raises(ValueError, match="unknown key"):
        load_rl_config(tmp_path / "key.toml")


def test_curriculum_opens_levels_in_order():
    env = EnvSection(name="a", difficulties=[3, 1, 2], curriculum_iterations=30)
    assert [env.levels_at(i) for i in (0, 9, 10, 19, 20, 99)] == [[1], [1], [1, 2], [1, 2], [1, 2, 3], [1, 2, 3]]
    assert EnvSection(name="b", difficulties=[2, 1]).levels_at(0) == [1, 2]


def test_weighted_draws_and_held_out_problems_are_disjoint(tmp_path):
    cfg = _two_env_config(tmp_path)
    envs = build_mixture(cfg, seed=0)
    counts = collections.Counter(choose_env(envs, seed).name for seed in range(4000))
    assert abs(counts["sums"] / 4000 - 0.75) < 0.03
    sums, morse = envs
    assert (sums.max_tokens, morse.max_tokens) == (10, 12)  # its own budget; else rollout.max_tokens
    assert len(sums.eval_problems) == cfg.task.eval_problems and len(morse.eval_problems) == 4
    for env in envs:
        for seed in range(200):
            problem = env.draw(seed, iteration=0)
            assert problem.prompt not in env.exclude
            assert env is morse or problem.difficulty == 1  # the curriculum starts at the easiest level


@pytest.mark.slow
def test_mixture_run_logs_per_env_metrics(tmp_path):
    cfg = _two_env_config(tmp_path, ["rollout.prompts_per_iteration=4", "train.iterations=2", "train.eval_every=2"])
    trainer = RLTrainer(cfg, tmp_path / "run")
    summary = trainer.run()
    assert summary.iteration == 2
    records = read_metrics(tmp_path / "run")
    for key in ("eval_reward/sums", "eval_reward/morse", "eval_reward_sampled/sums"):
        assert key in records[0] and key in records[-1], key
    trained = [r for r in records[1:] if r["groups_trained"]]
    assert trained and any("reward_mean/sums" in r or "reward_mean/morse" in r for r in trained)
    for g in trainer.rollout.paused:
        assert g.env in ("sums", "morse") and g.max_tokens == {"sums": 10, "morse": 12}[g.env]
