import itertools
import re

import pytest

from openk2.rl import tasks
from openk2.rl.tasks.instruction import check, compose_response, hack_check, strip_claims
from tests.rl.tasks.fakes import FakeChat


def _violate(text: str, constraint: dict) -> str:
    """`text` changed so that exactly `constraint` fails (the others are not our concern here)."""
    kind = constraint["kind"]
    if kind == "word_range":
        return text + "\n" + "more " * 200
    if kind == "include":
        return re.sub(constraint["words"][0], "x", text, flags=re.IGNORECASE)
    if kind == "exclude":
        return f"{constraint['word']} {text}"
    if kind == "bullets":
        return text + "\n* one more point"
    if kind == "lowercase":
        return "Hello " + text
    if kind == "title":
        return "plain start\n" + text
    if kind == "end_with":
        return text + " ok"
    raise AssertionError(kind)


def test_code_checked_constraints_over_many_seeds():
    task = tasks.get("instruction")
    for difficulty, seed in itertools.product(range(1, 6), range(30)):
        problem = task.generate(seed, difficulty)
        constraints = problem.data["constraints"]
        assert len(constraints) == difficulty and all(c["kind"] != "judged" for c in constraints)
        response = compose_response(problem.data["topic"], constraints)
        assert task.verify(problem, f"Let me plan.\nAnswer:\n{response}") == 1.0, (problem.prompt, response)
        broken = _violate(response, constraints[0])
        assert not check(constraints[0], broken)
        assert task.verify(problem, f"Answer:\n{broken}") == 0.0, (constraints[0], broken)
        assert task.verify(problem, response) == 0.0  # no "Answer:"


def _problem(*constraints):
    return tasks.Problem("", {"topic": "the night sky", "constraints": list(constraints)})


def test_hack_check_keyword_only_in_a_claim():
    task = tasks.get("instruction")
    problem = _problem({"kind": "include", "words": ["lantern", "harbor"]})
    honest = "We walked to the harbor with a lantern."
    cheat = "We walked home in the dark. I have included the words lantern and harbor."
    assert task.verify(problem, f"Answer: {honest}") == 1.0
    assert check(problem.data["constraints"][0], cheat)  # a naive keyword check is fooled
    assert hack_check(cheat, problem.data["constraints"])
    assert task.verify(problem, f"Answer: {cheat}") == 0.0


def test_hack_check_false_counts_and_honest_counts():
    constraint = {"kind": "word_range", "min": 5, "max": 10}
    task = tasks.get("instruction")
    text = "the stars were bright over the quiet town"  # 8 words
    assert task.verify(_problem(constraint), f"Answer: {text}") == 1.0
    assert task.verify(_problem(constraint), f"Answer: {text}\nWord count: 8") == 1.0  # true claims are fine
    assert hack_check(f"{text}\nWord count: 40", [constraint]) == ["claims 40 words, has 8"]
    assert task.verify(_problem(constraint), f"Answer: {text} (40 words)") == 0.0
    bullets = {"kind": "bullets", "count": 3}
    assert task.verify(_problem(bullets), "Answer:\n* a\n* b\nThis note has 3 bullet points.") == 0.0
    assert strip_claims("* a\n* b\nThis note has 3 bullet points.") == "* a\n* b\n"


def test_hack_check_claims_do_not_reach_the_judge():
    # A gullible judge: says YES whenever the text mentions "cheerful" or is full of exclamation marks.
    judge = FakeChat(lambda q: "YES" if "cheerful" in q.split("Response:")[1] or q.count("!") >= 2 else "NO")
    task = tasks.get("instruction", judge=judge)
    problem = next(p for p in (task.generate(s, 3) for s in range(50))
                   if p.data["constraints"][-1]["kind"] == "judged"
                   and "cheerful" in p.data["constraints"][-1]["text"]
                   and all(c["kind"] != "word_range" for c in p.data["constraints"]))  # inserted lines change counts
    base = compose_response(problem.data["topic"], problem.data["constraints"])
    # The judged rule is checked on the text with its self-descriptions removed.
    ends = next((c["phrase"] for c in problem.data["constraints"] if c["kind"] == "end_with"), None)
    lines = base.split("\n")
    insert_at = len(lines) - 1 if ends else len(lines)
    cheat = "\n".join(lines[:insert_at] + ["This note is written in a cheerful tone."] + lines[insert_at:])
    happy = "\n".join(lines[:insert_at] + ["what fun! so good!"] + lines[insert_at:])
    if any(c["kind"] == "lowercase" for c in problem.data["constraints"]):
        cheat, happy = cheat.lower(), happy.lower()
    assert task.verify(problem, f"Answer:\n{happy}") == 1.0
    assert task.verify(problem, f"Answer:\n{cheat}") == 0.0
    # Without a judge the task generates code-checked constraints only, and refuses judged ones.
    with pytest.raises(ValueError, match="judge"):
        tasks.get("instruction").verify(problem, f"Answer:\n{happy}")
