"""Self-critique in the loop: the rubric reward with its reward-hacking guard, and the critic's verifiable task
built from verified groups (closed-loop refinement)."""

import random
import re
import time

import pytest

from openk2.rl.config import load_rl_config
from openk2.rl.critic import SelfCritic
from openk2.rl.critic_compact import (
    COMPACT_FORMAT,
    CompactFormat,
    compact_prompt,
    question_text,
    slipped_solution,
    verdict_example,
)
from openk2.rl.critic_env import warmup_example
from openk2.rl.critic_loop import (
    LOOP_RUBRICS,
    CriticRefinementTask,
    SelfCritiqueReward,
    greedy_accuracy,
    hack_flags,
    verdict_score,
)
from openk2.rl.tasks.arithmetic import ArithmeticTask
from openk2.rl.tasks.base import extract_answer
from openk2.rl.warmup import sft_example, worked_solution
from tests.rl.tasks.fakes import FakeChat

from .test_critic import _pair, _verifying_critic


def _longest_wins(prompt: str) -> str:
    """A hackable critic: the longer response wins, nothing is ever flagged."""
    a, b = _pair(prompt)
    return f"Violations: none\nWinner: {'A' if len(a) > len(b) else ('B' if len(b) > len(a) else 'tie')}"


def test_hack_flags_name_each_hack_and_leave_plain_answers_alone():
    plain = ["The sum is 12.", "12", "It comes to 12 because 5 + 7 = 12."]
    assert not any(any(hack_flags(r, plain).values()) for r in plain)
    assert hack_flags("What a great question! It is 12.", plain)["flattery"]
    for claim in ("I have verified this: 12.", "This is 100% correct.", "Studies show it is 12.",
                  "My answer is correct: 12", "I ran the code and got 12."):
        assert hack_flags(claim, plain)["unverifiable_claim"], claim
    padded = "12. " + "To restate, the answer to the question you asked is twelve. " * 4
    assert hack_flags(padded, [*plain, padded])["length"] and not hack_flags(padded, [padded, padded])["length"]
    start = time.perf_counter()
    hack_flags("Great " * 2_000_000 + "question", ["x"])  # hostile: 12 MB, scanned in bounded time
    assert time.perf_counter() - start < 2.0


def test_rubric_reward_does_not_pay_for_hacks_a_weak_critic_falls_for():
    reward = SelfCritiqueReward(SelfCritic(FakeChat(_longest_wins), LOOP_RUBRICS))
    hacked = "Great question! I have double-checked this and it is 100% correct: the answer is 12. " * 3
    responses = ["12", "It is 12, since 5 + 7 = 12.", hacked]
    critic_only = reward.critic.rewards("What is 5 + 7?", responses)
    assert critic_only == [0.0, 0.5, 1.0]  # the critic alone ranks the hack first
    rewards = reward.group_rewards("What is 5 + 7?", responses)
    assert rewards[:2] == [0.0, 0.5] and rewards[2] == 0.0
    prompt = reward.critic.model.calls[0][0][0]["content"]
    assert "[prescriptive, mandatory] no-unverifiable-claims" in prompt and "[task, mandatory] correct" in prompt
    with pytest.raises(ValueError, match="hack_penalty"):
        SelfCritiqueReward(reward.critic, hack_penalty=-1)


def test_verdict_score_follows_the_critic_rules():
    assert verdict_score("...\nViolations: none\nWinner: B") == 0.0
    assert verdict_score("Violations: B\nWinner: B") == 1.0  # a mandatory violation overrides the preference
    assert verdict_score("Violations: both\nWinner: tie") == 0.5


def _group(task, seed):
    problem = task.generate(seed, 2)
    value = problem.data["answer"]
    responses = [f"Answer: {value}", f"Answer: {value + 1}", f"Working... Answer: {value}", "Answer: none"]
    return problem, responses, [task.verify(problem, r) for r in responses]


def test_refinement_task_scores_verdicts_against_the_verifier():
    task, critic_task = ArithmeticTask(), CriticRefinementTask(max_pairs_per_group=3, seed=0)
    problem, responses, rewards = _group(task, 0)
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    assert critic_task.observe(problem, responses, rewards) == 6  # 3 of the 4 differing pairs, both orders
    assert critic_task.observe(problem, responses[:1] * 3, [1.0] * 3) == 0  # the verifier has no preference
    pool = critic_task.pool
    assert [p.data["target"] for p in pool].count("A") == 3  # each pair once per order
    for p in pool:
        a, b = _pair(p.prompt)
        better = a if p.data["target"] == "A" else b
        assert task.verify(problem, better) == 1.0 and problem.prompt in p.prompt
        assert critic_task.generate(pool.index(p)) is p
        right, wrong = p.data["target"], "B" if p.data["target"] == "A" else "A"
        assert critic_task.verify(p, f"Violations: none\nWinner: {right}") == 1.0
        assert critic_task.verify(p, f"Violations: none\nWinner: {wrong}") == 0.0
        assert critic_task.verify(p, "Winner: tie") == 0.0 and critic_task.verify(p, "") == 0.0
        assert critic_task.verify(p, f"Violations: {right}\nWinner: {right}") == 0.0
    # a position-biased critic scores exactly chance over the pool; a verifying one is always right
    assert sum(critic_task.verify(p, "Winner: A") for p in pool) / len(pool) == 0.5
    solver = _verifying_critic()
    assert all(critic_task.verify(p, solver.reply(p.prompt)) == 1.0 for p in pool)


def test_refinement_pool_keeps_the_newest_comparisons_and_rejects_bad_input():
    task, critic_task = ArithmeticTask(), CriticRefinementTask(max_pairs_per_group=4, max_pool=10)
    with pytest.raises(ValueError, match="no comparisons yet"):
        critic_task.generate(0)
    for seed in range(3):
        critic_task.observe(*_group(task, seed))
    assert len(critic_task.pool) == 10
    newest = _group(task, 2)[0].prompt
    assert all(newest in p.prompt for p in critic_task.pool[-8:])
    with pytest.raises(ValueError, match="rewards"):
        critic_task.observe(newest and _group(task, 0)[0], ["a", "b"], [1.0])
    with pytest.raises(ValueError, match="max_pairs_per_group"):
        CriticRefinementTask(max_pairs_per_group=0)
    with pytest.raises(ValueError, match="rubric"):
        CriticRefinementTask(rubrics=[])


def test_greedy_accuracy_against_the_verifier():
    task = ArithmeticTask()
    groups = [_group(task, s) for s in range(3)]
    problems, responses = [g[0] for g in groups], [g[1] for g in groups]
    assert greedy_accuracy(SelfCritic(_verifying_critic()), task, problems, responses) == 1.0
    assert greedy_accuracy(SelfCritic(_verifying_critic(contrarian=True)), task, problems, responses) == 0.0
    assert greedy_accuracy(SelfCritic(FakeChat(lambda p: "Winner: A")), task, problems, responses) == 0.0
    same = [[r[0]] * 2 for r in responses]
    assert greedy_accuracy(SelfCritic(_verifying_critic()), task, problems, same) is None
    assert re.search("Compute", problems[0].prompt)


def test_compact_comparisons_fit_a_small_policy_and_score_against_the_verifier():
    task = ArithmeticTask()
    critic_task = CriticRefinementTask(fmt=COMPACT_FORMAT, max_tokens=16, seed=1)
    problem, responses, rewards = _group(task, 3)
    assert critic_task.observe(problem, responses, rewards) == 8 and critic_task.max_tokens == 16
    value = problem.data["answer"]
    for p in critic_task.pool:
        assert len(p.prompt) < 300 and "no-flattery" not in p.prompt and "Finish with a last line of the form " \
            '"Answer: <your answer>"' not in p.prompt  # the task's own instruction gives way to the critic's
        assert question_text(problem.prompt) in p.prompt and p.prompt.endswith('"Answer: A" or "Answer: B".')
        right = p.data["target"]
        wrong = "B" if right == "A" else "A"
        assert critic_task.verify(p, f"Answer: {right}") == 1.0 and critic_task.verify(p, f"Answer: {wrong}") == 0.0
        a, b = p.data["responses"]
        named = "A" if extract_answer(a) == str(value) else "B"  # a right answer's value names its response
        assert critic_task.verify(p, f"{value}\nAnswer: {value}") == float(named == right)
        assert critic_task.verify(p, f"7-1=6\n{value}") == float(named == right)  # a bare last line is read too
        assert critic_task.verify(p, f"{right}.") == 1.0 and critic_task.verify(p, "Answer: 12345") == 0.0
        assert critic_task.verify(p, "") == 0.0 and critic_task.verify(p, "\n \n") == 0.0
    assert sum(critic_task.verify(p, "Answer: A") for p in critic_task.pool) / len(critic_task.pool) == 0.5
    hostile = compact_prompt("Compute 1+1.", "x" * 10_000, "Answer: 2")
    assert len(hostile) < 400  # responses are cut, so a huge one cannot blow the critic's context
    with pytest.raises(ValueError, match="max_chars"):
        CompactFormat(max_chars=0)


def test_warm_up_verdicts_pick_the_worked_solution_in_either_order():
    task, letters = ArithmeticTask(), set()
    for seed in range(60):
        problem = task.generate(seed, 3)
        (prompt, trained_prompt), (target, trained) = verdict_example(problem)
        assert not trained_prompt and trained and target.startswith("Answer: ")
        a, b = re.search(r"\nA: (.*)\nB: (.*)\nWhich", prompt, re.DOTALL).groups()
        right = worked_solution(problem.data["expression"])
        letter = target.removeprefix("Answer: ")[0]
        assert (a, b)[letter == "B"] == right and extract_answer((a, b)[letter == "A"]) != extract_answer(right)
        letters.add(letter)
    assert letters == {"A", "B"}
    assert slipped_solution("0", random.Random(0)) == "Answer: 1"
    mixed = warmup_example(0.25)
    shares = [mixed(task.generate(s, 3)) != sft_example(task.generate(s, 3)) for s in range(400)]
    assert 0.15 < sum(shares) / len(shares) < 0.35 and warmup_example(0.0) is sft_example
    with pytest.raises(ValueError, match=r"warmup.verdict_share must be in \[0, 1\), got 1.0"):
        load_rl_config(None, ["warmup.verdict_share=1.0"])
