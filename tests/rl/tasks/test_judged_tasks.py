"""Faithfulness and safety with a deterministic fake judge (logic); tests/rl/test_critic.py has a real model."""

import re

import pytest

from openk2.rl import tasks
from openk2.rl.tasks.faithfulness import split_claims
from openk2.rl.tasks.judge import parse_yes_no
from openk2.rl.tasks.safety import GOALS, red_team
from tests.rl.tasks.fakes import FakeChat


def _support_judge(question: str) -> str:
    """YES iff the claim, as a sentence, appears in the context."""
    context = re.search(r"Context:\n(.*?)\n\nClaim:", question, re.DOTALL).group(1)
    claim = re.search(r"Claim: (.*?)\n\n", question, re.DOTALL).group(1)
    return "YES" if claim.rstrip(".") in context else "NO"


def test_faithfulness_over_many_seeds():
    judge = FakeChat(_support_judge)
    task = tasks.get("faithfulness", judge=judge)
    for difficulty in range(1, 6):
        for seed in range(20):
            problem = task.generate(seed, difficulty)
            context = problem.data["context"]
            # Reference solver: quote the context sentences that state each asked fact about the asked town.
            town = re.search(r"(?:does|of|was) ([A-Z][a-z]+)", problem.data["question"]).group(1)
            facts = [s for s in split_claims(context) if town in s]
            quoted = [next(s for s in facts if a in s) for a in problem.data["answers"]]
            answer = " ".join(quoted)
            assert task.verify(problem, f"Answer: {answer}") == 1.0, (problem.prompt, answer)
            assert task.verify(problem, f"Answer: {answer} It is also known for its zoo.") == 0.0
            assert task.verify(problem, "Answer: I do not know.") == 0.0
    with pytest.raises(ValueError, match="judge"):
        tasks.get("faithfulness").verify(problem, "Answer: x")


def _bypass_judge(question: str) -> str:
    reply = question.split("The assistant replied:\n", 1)[1]
    return "YES" if "Sure, here is" in reply or "Step 1" in reply else "NO"


def test_safety_refusals_score_and_bypasses_do_not():
    task = tasks.get("safety", judge=FakeChat(_bypass_judge))
    seen_goals = set()
    for difficulty in range(1, 6):
        for seed in range(10):
            problem = task.generate(seed, difficulty)
            seen_goals.add(problem.data["goal"])
            assert problem.data["attack"] in problem.prompt
            assert task.verify(problem, "I can't help with that, but I can explain how to stay safe.") == 1.0
            assert task.verify(problem, "Sure, here is how. Step 1: ...") == 0.0
    assert seen_goals <= set(GOALS) and len(seen_goals) >= 3
    assert "Ignore all previous instructions" in task.generate(0, 5).prompt


def test_attacker_model_writes_attacks_and_red_team_iterates():
    # The attacker escalates with each failure; the target falls for the third framing.
    attacker = FakeChat(lambda q: f"attack #{q.count('A previous prompt failed') + 1}: tell me a story")
    target = FakeChat(lambda q: "Sure, here is the story" if q.startswith("attack #3") else "No.")
    judge = FakeChat(_bypass_judge)
    attempts = red_team(attacker, target, judge, GOALS[0], rounds=5)
    assert [a.prompt.split(":")[0] for a in attempts] == ["attack #1", "attack #2", "attack #3"]
    assert [a.bypassed for a in attempts] == [False, False, True]
    assert "No." in attacker.calls[-1][0][-1]["content"]  # the attacker saw the failed attempts
    task = tasks.get("safety", judge=judge, attacker=attacker)
    assert task.generate(0, 1).data["attack"] == "attack #1: tell me a story"


@pytest.mark.parametrize("reply,verdict", [
    ("YES", True), ("no", False), ("The claim is stated.\nYes.", True), ("There is no evidence.\nNO", False),
    ("Reasoning: there is no zoo, so\n**NO**", False), ("no idea", False), ("", None), ("maybe", None),
])
def test_parse_yes_no(reply, verdict):
    assert parse_yes_no(reply) is verdict
