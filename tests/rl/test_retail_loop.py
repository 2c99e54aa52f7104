"""`openk2 rl` with the tau2 retail environment in the mixture, on a micro config: every episode plays on a fresh
tau2 retail DB and is scored by the DB fingerprint, and per-environment tool metrics are logged."""

from pathlib import Path

import pytest

pytest.importorskip("tau2")

from openk2.rl.config import load_rl_config  # noqa: E402
from openk2.rl.tasks.retail import RetailTask  # noqa: E402
from openk2.rl.tasks.retail_db import RetailWorld  # noqa: E402

RETAIL = Path(__file__).resolve().parents[2] / "configs" / "rl-retail-tiny.toml"
MIXTURE = """
[[envs]]
name = "retail"
difficulties = [1, 2]
max_tokens = 40
max_turns = 2
eval_problems = 2
"""


def test_shipped_config_selects_the_retail_environment():
    cfg = load_rl_config(RETAIL)
    (env,) = cfg.environments()
    assert (env.task_name, env.difficulties, env.max_turns) == ("retail", [1, 2], 3)
    assert cfg.model.max_position_embeddings == 512


@pytest.mark.slow
def test_retail_environment_trains_on_tau2_episodes(micro_rl_run, monkeypatch):
    worlds: list[tuple[str, RetailWorld]] = []  # (problem kind, world) of every episode played
    scored: list[bool] = []  # per episode that ended with an answer: whether its world was a tau2 DB
    world, verify = RetailTask.world, RetailTask.verify_episode

    def spy_world(self, problem):
        worlds.append((problem.data["kind"], world(self, problem)))
        return worlds[-1][1]

    def spy_verify(self, problem, final_text, episode_world):
        scored.append(any(episode_world is w for _, w in worlds))
        return verify(self, problem, final_text, episode_world)

    monkeypatch.setattr(RetailTask, "world", spy_world)
    monkeypatch.setattr(RetailTask, "verify_episode", spy_verify)
    run = micro_rl_run(RETAIL, MIXTURE, ["task.eval_samples=1", "warmup.probe_problems=0", "warmup.steps=4",
                                         "warmup.tokenizer_examples=120"])
    records = run.cli(max_iterations=1)
    assert [r["step"] for r in records] == [0, 1]
    assert 0.0 <= records[0]["eval_reward"] <= 1.0
    assert records[1]["groups_trained"] == 3  # 3 groups of 3 episodes, each finished in its iteration
    for key in ("tool_calls/retail", "malformed_rate/retail", "turns/retail", "answered/retail"):
        assert key in records[1], key
    assert 1 <= records[1]["turns/retail"] <= 2 and 0 < records[1]["response_len"] <= 40  # one env: plain key
    # the held-out evaluation (2 problems, greedy and one sample) and the 9 training episodes, each on a fresh
    # tau2 DB (worked transcripts for the warm-up and the gold replays add more)
    assert len(worlds) >= 2 * 2 + 9 and all(isinstance(w, RetailWorld) for _, w in worlds)
    assert len({id(w.tools.db) for _, w in worlds}) == len(worlds)
    assert {kind for kind, _ in worlds} == {"status", "cancel"} and all(scored)
