from openk2.rl import tasks
from openk2.rl.tasks.arithmetic import parse_int


def test_arithmetic_verifier_over_many_seeds():
    task = tasks.get("arithmetic")
    for difficulty in range(1, task.num_difficulties + 1):
        for seed in range(100):
            problem = task.generate(seed, difficulty)
            expression = problem.data["expression"]
            assert problem.prompt.startswith(f"Compute {expression}.")
            # Reference solver: Python's own integer arithmetic on the generated string (digits and + - * only).
            assert set(expression) <= set("0123456789+-*")
            value = eval(expression)  # noqa: S307 - trusted, generated above
            assert task.verify(problem, f"Let me think.\nAnswer: {value}") == 1.0
            assert task.verify(problem, f"Answer: {value + 1}") == 0.0
            assert task.verify(problem, f"{value}") == 0.0  # no "Answer:" line


def test_arithmetic_difficulty_grows():
    task = tasks.get("arithmetic")
    assert max(len(task.generate(s, 1).data["expression"]) for s in range(50)) == 3
    assert max(len(task.generate(s, 5).data["expression"]) for s in range(50)) == 8
    ops = {c for s in range(50) for c in task.generate(s, 1).data["expression"] if not c.isdigit()}
    assert ops == {"+", "-"}


def test_parse_int():
    assert parse_int("1,024") == 1024 and parse_int("+7") == 7 and parse_int("-3") == -3
    assert parse_int("3.0") is None and parse_int("seven") is None and parse_int(None) is None
