import pytest

from openk2.rl import tasks
from openk2.rl.tasks.code import extract_code, reference_solution


def test_code_task_runs_unit_tests_in_the_sandbox():
    task = tasks.get("code", timeout_s=5.0)
    for difficulty in range(1, task.num_difficulties + 1):
        problem = task.generate(0, difficulty)
        solution = reference_solution(problem)
        assert problem.data["function"] in problem.prompt and problem.data["tests"].count("def test_") == 6
        assert task.verify(problem, f"Here you go.\nAnswer:\n```python\n{solution}```") == 1.0
    problem = task.generate(1, 1)
    name = problem.data["function"]
    # Perturbed: a wrong implementation fails the tests; a crash or a hang scores 0.
    assert task.verify(problem, f"Answer:\n```python\ndef {name}(xs):\n    return -12345\n```") == 0.0
    assert task.verify(problem, f"Answer:\n```python\ndef {name}(xs):\n    raise RuntimeError\n```") == 0.0
    assert tasks.get("code", timeout_s=2.0).verify(problem, f"Answer:\ndef {name}(xs):\n    while True: pass\n") == 0.0
    # Partial credit: right on empty-or-zero-sum inputs only.
    partial = f"Answer:\n```python\ndef {name}(xs):\n    return 0\n```"
    expected_zero = problem.data["tests"].count(", 0)\n")
    assert 0 < expected_zero < 6
    assert task.verify(problem, partial) == pytest.approx(expected_zero / 6)
    # Strict types: the right numbers as floats, or a bool for 0, are wrong answers.
    floats = f"Answer:\n```python\n{reference_solution(problem)}\n_f = {name}\n{name} = lambda xs: float(_f(xs))\n```"
    assert task.verify(problem, floats) == 0.0
    assert task.verify(problem, f"Answer:\n```python\ndef {name}(xs):\n    return False\n```") == 0.0


def test_extract_code():
    assert extract_code("blah\n```python\nx = 1\n```\nAnswer:\n```python\nx = 2\n```") == "x = 2\n"
    assert extract_code("only a block\n```py\nx = 3\n```") == "x = 3\n"
    assert extract_code("Answer: x = 4") == "x = 4"
    assert extract_code("no code") is None
