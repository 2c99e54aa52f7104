"""Self-critique in `openk2 rl`: the critic environment fed by the verified groups (closed loop), self-critique
rewards from the policy-as-critic, the pools across a resume, and a short real run mixing them."""

import json
import re

import pytest
import torch

from openk2.rl import tasks
from openk2.rl.config import load_rl_config
from openk2.rl.critic import SelfCritic
from openk2.rl.critic_env import CriticEnv, CriticLoop, build_loop_env
from openk2.rl.critic_loop import LOOP_RUBRICS
from openk2.rl.mixture import build_mixture, choose_env
from openk2.rl.rollout import new_group
from openk2.rl.tasks.base import Problem, Task
from openk2.rl.trainer import RLTrainer
from openk2.train.metrics import read_metrics
from tests.rl.tasks.fakes import FakeChat
from tests.rl.test_trainer import CONFIG, MICRO

LOOP = """base = "{base}"

[[envs]]
name = "arithmetic"
difficulties = [2]
eval_problems = 4

[[envs]]
name = "open"
task = "arithmetic"
reward = "self-critique"
eval_problems = 2

[[envs]]
name = "critic"
task = "critic"
weight = 2.0
eval_problems = 6
{extra}"""



def _config(tmp_path, extra="", overrides=()):
    path = tmp_path / "critic.toml"
    path.write_text(LOOP.format(base=CONFIG.as_posix(), extra=extra))
    return load_rl_config(path, [*MICRO, *overrides])


def _loop(tmp_path):
    cfg = _config(tmp_path)
    envs = build_mixture(cfg, 0, build_loop_env)
    return envs, CriticLoop.build(envs, None, 0, cfg)


def _groups(envs, texts_by_env):
    """Groups whose trajectory i decodes to texts_by_env[env][i] (token id = index into TEXTS)."""
    groups, table = [], []
    for gid, (name, texts) in enumerate(texts_by_env):
        env = next(e for e in envs if e.name == name)
        problem = env.draw(gid, 0) if not isinstance(env, CriticEnv) else env.task.pool[0]
        group = new_group(gid, problem, [0], len(texts), 0, env=name)
        for traj, text in zip(group.trajectories, texts, strict=True):
            traj.token_ids = [len(table)]
            table.append(text)
        groups.append(group)
    return groups, lambda ids: table[ids[0]]


def _answers(problem, right=2):
    """Four responses to `problem`, the first `right` of them right."""
    value = problem.data["answer"]
    return [f"Answer: {value}"] * right + [f"Answer: {value + k}" for k in (1, 2, 3)][: 4 - right]


def test_verified_groups_feed_the_critic_env_before_it_is_drawn(tmp_path):
    envs, loop = _loop(tmp_path)
    critic = next(e for e in envs if isinstance(e, CriticEnv))
    assert loop.sources == {"arithmetic"} and not critic.ready and critic.eval_problems == []
    assert all(choose_env(envs, s) is not critic for s in range(300))  # the start: not drawn while empty
    arith = next(e for e in envs if e.name == "arithmetic")
    problem = arith.draw(0, 0)
    answers = _answers(problem)
    groups, decode = _groups(envs, [("arithmetic", answers), ("open", answers)])
    groups[0].problem = problem
    raw = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    record = loop.observe(groups, raw, decode)
    assert record == {"critic_observed": 8, "critic_pool": 8}  # 4 differing pairs, both orders; "open" is no source
    assert critic.ready and sum(choose_env(envs, s) is critic for s in range(300)) > 100  # weight 2 of 4
    for comparison in critic.task.pool:
        a, b = re.search(r"\nA: (.*)\nB: (.*)\nWhich", comparison.prompt).groups()
        assert "Compute" in comparison.prompt and "Finish with" not in comparison.prompt.split("\nA: ")[0]
        right = "A" if a == f"Answer: {problem.data['answer']}" else "B"
        assert comparison.data["target"] == right
        assert critic.task.verify(comparison, f"Answer: {right}") == 1.0
        assert critic.task.verify(comparison, f"Answer: {problem.data['answer']}") == 1.0  # names it by value
        assert critic.task.verify(comparison, f"Answer: {'B' if right == 'A' else 'A'}") == 0.0
    # the critic's own groups are trained on, never observed again; their mean reward is its sampled accuracy
    groups, decode = _groups(envs, [("critic", ["Answer: A", "Answer: B", "x", "Answer: A"])])
    record = loop.observe(groups, torch.tensor([[1.0, 0.0, 0.0, 1.0]]), decode)
    assert record == {"critic_accuracy_sampled": 0.5, "critic_observed": 0, "critic_pool": 8}


def _right_value_wins(prompt: str) -> str:
    """A scripted compact critic: the response with the right value wins (ties when both or neither has it)."""
    expression = re.search(r"Compute (.*?)\.", prompt).group(1)
    a, b = re.search(r"\nA: (.*)\nB: (.*)\nWhich", prompt, re.DOTALL).groups()
    right = f"Answer: {eval(expression)}"  # noqa: S307 - our own generated digits and + - *
    a_ok, b_ok = a.endswith(right), b.endswith(right)
    return "Answer: tie" if a_ok == b_ok else f"Answer: {'A' if a_ok else 'B'}"


def test_self_critique_rewards_come_from_the_critic_minus_hack_penalties(tmp_path):
    envs, loop = _loop(tmp_path)
    scripted = FakeChat(_right_value_wins)
    loop.make_critic = lambda fmt, policy: SelfCritic(scripted, LOOP_RUBRICS, fmt=fmt)
    open_env, arith = (next(e for e in envs if e.name == n) for n in ("open", "arithmetic"))
    problem = open_env.draw(3, 0)
    value = problem.data["answer"]
    texts = [f"Answer: {value}", f"Answer: {value + 1}", f"Great question! I verified it. Answer: {value}"]
    rewards = loop.rewards(open_env, problem, texts, policy=None)
    # round robin: right beats wrong, ties the hacked one (0.75); the hack's 0.75 loses 2 x 0.5 for two hacks
    assert rewards == [0.75, 0.0, 0.0]
    assert len(scripted.calls) == 3 * 2  # every pair, both orders
    prompt = scripted.calls[0][0][0]["content"]
    assert "Which response is right?" in prompt and "no-flattery" not in prompt  # the compact prompt
    assert loop.rewards(arith, problem, texts, policy=None) is None  # a verifier env: task.verify as before


def test_resume_restores_the_pool_and_the_held_out_comparisons(tmp_path):
    envs, loop = _loop(tmp_path)
    problem = next(e for e in envs if e.name == "arithmetic").draw(0, 0)
    groups, decode = _groups(envs, [("arithmetic", _answers(problem, right=1))] * 2)
    for g in groups:
        g.problem = problem
    raw = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 2)
    loop.observe(groups[:1], raw[:1], decode)
    loop.held_out = {"critic": list(loop.critics[0].task.pool[:2])}
    state = json.loads(json.dumps(loop.state_dict()))  # what rl_state.json holds
    envs2, resumed = _loop(tmp_path)
    resumed.load_state_dict(state)
    assert resumed.critics[0].task.pool == loop.critics[0].task.pool and resumed.held_out == loop.held_out
    loop.observe(groups[1:], raw[1:], decode)  # the pair-sampling RNG continues where it stopped
    resumed.observe(groups[1:], raw[1:], decode)
    assert [p.prompt for p in resumed.critics[0].task.pool] == [p.prompt for p in loop.critics[0].task.pool]


def test_a_critic_env_needs_a_verifier_env(tmp_path):
    cfg = _config(tmp_path)
    envs = [e for e in build_mixture(cfg, 0, build_loop_env) if e.name != "arithmetic"]
    with pytest.raises(ValueError, match="verifier-rewarded"):
        CriticLoop.build(envs, None, 0, cfg)
    with pytest.raises(ValueError, match="envs.reward"):
        _config(tmp_path, extra='\n[[envs]]\nname = "x"\ntask = "arithmetic"\nreward = "vibes"\n')


class CoinTask(Task):
    """A real verifier that even an untrained policy's samples split: the parity of the response's characters."""

    name = "coin"
    num_difficulties = 1

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        return self._problem(f"Compute {seed % 10}+{seed // 10 % 10}.", {}, seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        return float(sum(map(ord, response_text)) % 2 == 0)


@pytest.mark.slow
def test_short_run_trains_the_critic_on_policy_and_resumes(tmp_path):
    tasks.register("critic-test-coin", CoinTask)
    coin = '\n[[envs]]\nname = "coin"\ntask = "critic-test-coin"\nweight = 3.0\neval_problems = 6\n'
    cfg = _config(tmp_path, extra=coin, overrides=["rollout.segment_tokens=0", "rollout.prompts_per_iteration=6",
                                                    "train.iterations=3", "train.checkpoint_every=3"])
    out = tmp_path / "run"
    RLTrainer(cfg, out).run()
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert 0.0 <= records[0]["critic_accuracy"] <= 1.0 and records[0]["critic_eval_comparisons"] > 0
    assert "critic_accuracy" in records[2] and "critic_accuracy" in records[3]
    assert records[1]["critic_pool"] > 0  # iteration 1's verified groups, observed before its training step
    critic_rows = [r for r in records[1:] if r.get("groups_trained/critic")]
    assert critic_rows and all(0.0 <= r["critic_accuracy_sampled"] <= 1.0 for r in critic_rows)
    state = json.loads((out / "checkpoints" / "step-0000003" / "rl_state.json").read_text())["critic"]
    assert state["pools"]["critic"]["pool"] and len(state["held_out"]["critic"]) == records[0][
        "critic_eval_comparisons"]
    resumed = RLTrainer(cfg, out, resume=True)
    assert [vars(p) for p in resumed.critic.critics[0].task.pool] == state["pools"]["critic"]["pool"]
    assert resumed.critic.evaluate(resumed.inference)["critic_eval_comparisons"] == len(state["held_out"]["critic"])


def test_an_eval_only_mixture_is_refused_and_the_key_is_checked(tmp_path):
    only = '\n[[envs]]\nname = "arithmetic"\neval_only = true\n'
    path = tmp_path / "only.toml"
    path.write_text(f'base = "{CONFIG.as_posix()}"\n{only}')
    with pytest.raises(ValueError, match="every \\[\\[envs\\]\\] entry is eval_only"):
        build_mixture(load_rl_config(path, MICRO), 0, build_loop_env)
    path.write_text(f'base = "{CONFIG.as_posix()}"\n{only.replace("true", chr(34) + "yes" + chr(34))}')
    with pytest.raises(ValueError, match="envs\\[0\\].eval_only must be true or false"):
        load_rl_config(path, MICRO)


CONTROL = """base = "{base}"

[[envs]]
name = "arithmetic"
difficulties = [2]
weight = 0.5
eval_problems = 4

[[envs]]
name = "coin"
task = "critic-test-coin"
eval_problems = 6

[[envs]]
name = "critic"
task = "critic"
weight = 3.0
eval_problems = 6
eval_only = true
"""


@pytest.mark.slow
def test_an_eval_only_critic_is_evaluated_and_never_trained_on(tmp_path):
    tasks.register("critic-test-coin", CoinTask)
    path = tmp_path / "control.toml"
    path.write_text(CONTROL.format(base=CONFIG.as_posix()))
    cfg = load_rl_config(path, [*MICRO, "rollout.segment_tokens=0", "rollout.prompts_per_iteration=4",
                                "train.iterations=3", "train.eval_every=3", "train.checkpoint_every=3"])
    out = tmp_path / "run"
    trainer = RLTrainer(cfg, out)
    trainer.run()
    records = read_metrics(out)
    assert records[0]["critic_eval_comparisons"] > 0 and 0.0 <= records[3]["critic_accuracy"] <= 1.0
    assert records[1]["critic_pool"] > 0 and records[3]["critic_pool"] > records[1]["critic_pool"]  # still observed
    assert not any("groups_trained/critic" in r or "critic_accuracy_sampled" in r for r in records)
    skipped = sum(r["groups_not_started"] for r in records[1:])  # drawn for the critic (3 of 4.5), not started
    assert skipped > 0 and sum(r["groups_trained"] for r in records[1:]) == 3 * 4 - skipped
    assert trainer.next_group == 3 * 4  # its draws use up their group ids: the other envs' problems are unchanged
