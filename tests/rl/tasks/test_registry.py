import json

import pytest

from openk2.rl import tasks
from openk2.rl.tasks import Problem, Task, extract_answer


def test_names_and_unknown():
    assert {"arithmetic", "game24", "sudoku", "math", "morse"} <= set(tasks.names())
    with pytest.raises(ValueError, match="unknown RL task"):
        tasks.get("no-such-task")
    with pytest.raises(ValueError, match="does not take"):
        tasks.get("arithmetic", judge=object())  # only LLM-judged tasks take a judge


def test_every_builtin_task_generates_a_problem_with_the_answer_instruction():
    for name in tasks.names():
        task = tasks.get(name)
        assert isinstance(task, Task) and task.name == name and task.max_tokens > 0
        for difficulty in (1, task.num_difficulties):
            problem = task.generate(seed=3, difficulty=difficulty)
            assert problem.prompt.endswith(task.answer_instruction) and problem.task == name
            assert task.generate(seed=3, difficulty=difficulty) == problem  # deterministic
        assert task.generate(seed=4, difficulty=1) != task.generate(seed=3, difficulty=1)
        with pytest.raises(ValueError, match="difficulty"):
            task.generate(seed=0, difficulty=task.num_difficulties + 1)


def test_register_a_user_task_in_one_file():
    class Echo(Task):
        name = "echo"
        num_difficulties = 1

        def generate(self, seed, difficulty=1):
            return self._problem(f"Say {seed}.", {"word": str(seed)}, seed, difficulty)

        def verify(self, problem, response_text):
            return float(extract_answer(response_text) == problem.data["word"])

    tasks.register("echo", Echo)
    try:
        task = tasks.get("echo")
        assert "echo" in tasks.names()
        problem = task.generate(7)
        assert task.verify(problem, "ok\nAnswer: 7") == 1.0 and task.verify(problem, "Answer: 8") == 0.0
    finally:
        tasks._USER.pop("echo")
    with pytest.raises(ValueError):
        tasks.register("rg:x", Echo)


@pytest.mark.parametrize("text,answer", [
    ("Answer: 42", "42"),
    ("First answer: 1\nthen Answer: 2.", "2"),
    ("answer:   -3  \nthanks", "-3"),
    ("Answer: $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
    ("so \\boxed{x^{2}} is it", "x^{2}"),
    ("no final answer here", None),
    ("", None),
    (None, None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_problem_is_plain_data():
    p = Problem("q", {"a": 1}, "t", 1, 2)
    assert p.data == {"a": 1} and p.difficulty == 2


def test_cli(capsys):
    from openk2.cli.rl_tasks import rl_tasks_main

    assert rl_tasks_main(["list"]) == 0
    assert "sudoku" in capsys.readouterr().out
    assert rl_tasks_main(["sample", "arithmetic", "--seed", "3", "--count", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["seed"] for r in rows] == [3, 4] and rows[0]["task"] == "arithmetic"
    answer = tasks.get("arithmetic").generate(3, 1).data["answer"]
    assert rl_tasks_main(["check", "arithmetic", "--seed", "3", f"Answer: {answer}"]) == 0
    assert capsys.readouterr().out.strip() == "1.0"
    with pytest.raises(ValueError, match="unknown RL task"):
        rl_tasks_main(["sample", "nope"])
