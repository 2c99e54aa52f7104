"""Property tests: generate many instances, solve them with a reference solver, verify; perturb, reject."""

import itertools
import random

import pytest

from openk2.rl import tasks
from openk2.rl.tasks.cryptarithm import is_solution, solve_cryptarithm
from openk2.rl.tasks.game24 import FRACTION_ONLY, solve24
from openk2.rl.tasks.morse import MORSE, decode_morse, encode_morse
from openk2.rl.tasks.sudoku import is_solved, solve_sudoku
from openk2.rl.tasks.tables import answer_query

SEEDS = range(25)


def _levels(task):
    return range(1, task.num_difficulties + 1)


def test_game24():
    task = tasks.get("game24")
    for difficulty, seed in itertools.product(_levels(task), SEEDS):
        problem = task.generate(seed, difficulty)
        numbers = problem.data["numbers"]
        assert len(numbers) == 4 and all(1 <= n <= 13 for n in numbers)
        expression = solve24(numbers)
        assert task.verify(problem, f"Working...\nAnswer: {expression}") == 1.0
        assert task.verify(problem, f"Answer: {expression} = 24") == 1.0
        assert task.verify(problem, f"Answer: {expression} + 1") == 0.0  # wrong value, extra number
        assert task.verify(problem, f"Answer: ({expression}) * 1") == 0.0  # right value, number not given
        assert task.verify(problem, "Answer: __import__('os')") == 0.0
    # Level 4 is exactly the fraction-only sets.
    assert sorted(task.generate(0, 4).data["numbers"]) in [list(s) for s in FRACTION_ONLY]
    assert all(solve24(list(s)) and solve24(list(s), integers_only=True) is None for s in FRACTION_ONLY)
    assert task.verify(task.generate(0, 1), "Answer: 8 / (3 - 8 / 3)") == 0.0  # valid 24, other numbers
    problem = tasks.Problem("", {"numbers": [3, 3, 8, 8]})
    assert task.verify(problem, "Answer: 8 / (3 - 8 / 3)") == 1.0 and task.verify(problem, "Answer: 8*3") == 0.0


def test_sudoku():
    task = tasks.get("sudoku")
    for difficulty, seed in itertools.product(_levels(task), range(8)):
        problem = task.generate(seed, difficulty)
        puzzle = problem.data["puzzle"]
        assert len(puzzle) == 81 and set(puzzle) <= set("123456789.")
        solution = solve_sudoku(puzzle)
        assert solution is not None and is_solved(solution)
        grid = "\n".join(" ".join(solution[r * 9:r * 9 + 9]) for r in range(9))
        assert task.verify(problem, f"Answer: {solution}") == 1.0
        assert task.verify(problem, f"Here it is.\nAnswer:\n{grid}") == 1.0
        # Swap two different digits in a row: rows still hold 1-9 but columns (or a given) break.
        row = list(solution[:9])
        j = next(j for j in range(1, 9) if row[j] != row[0])
        row[0], row[j] = row[j], row[0]
        assert task.verify(problem, f"Answer: {''.join(row) + solution[9:]}") == 0.0
        assert task.verify(problem, f"Answer: {solution[:80]}") == 0.0
    assert solve_sudoku("11" + "." * 79) is None


def test_cryptarithm():
    task = tasks.get("cryptarithm")
    for difficulty, seed in itertools.product(_levels(task), SEEDS):
        problem = task.generate(seed, difficulty)
        addends, total = problem.data["addends"], problem.data["total"]
        mapping = solve_cryptarithm(addends, total)
        assert mapping is not None and is_solution(addends, total, mapping)
        text = ", ".join(f"{k}={v}" for k, v in sorted(mapping.items()))
        assert task.verify(problem, f"Answer: {text}") == 1.0
        assert task.verify(problem, f"Answer: {text.lower()}") == 1.0
        letter = total[-1]  # the units letter: changing it breaks the sum
        wrong = dict(mapping, **{letter: (mapping[letter] + 1) % 10})
        assert task.verify(problem, "Answer: " + ", ".join(f"{k}={v}" for k, v in wrong.items())) == 0.0
        missing = dict(list(mapping.items())[1:])
        assert task.verify(problem, "Answer: " + ", ".join(f"{k}={v}" for k, v in missing.items())) == 0.0
    assert is_solution(["SEND", "MORE"], "MONEY", solve_cryptarithm(["SEND", "MORE"], "MONEY"))
    assert solve_cryptarithm(["AB"], "AB") is not None and solve_cryptarithm(["A", "A"], "A") == {"A": 0}
    assert solve_cryptarithm(["AB", "CD"], "E") is None  # two-digit sum cannot be one digit


def test_morse():
    task = tasks.get("morse")
    assert decode_morse(encode_morse("SOS 42")) == "SOS 42"
    assert len(set(MORSE.values())) == len(MORSE)
    with pytest.raises(ValueError):
        encode_morse("hi!")
    for difficulty, seed in itertools.product(_levels(task), SEEDS):
        problem = task.generate(seed, difficulty)
        text = decode_morse(problem.data["morse"])
        assert task.verify(problem, f"Answer: {text}") == 1.0
        assert task.verify(problem, f"Answer:  {text.lower()}  ") == 1.0
        assert task.verify(problem, f"Answer: {text[:-1]}") == 0.0
        assert task.verify(problem, f"Answer: {text} X") == 0.0


def test_tables():
    task = tasks.get("tables")
    for difficulty, seed in itertools.product(_levels(task), SEEDS):
        problem = task.generate(seed, difficulty)
        tables, query = problem.data["tables"], problem.data["query"]
        answer = _solve_tables_by_hand(tables, query)
        assert answer == answer_query(tables, query)
        for row in tables["employees"]:
            assert f"| {row['name']} | {row['department']} | {row['salary']} | {row['age']} |" in problem.prompt
        assert task.verify(problem, f"Answer: {answer}") == 1.0
        if isinstance(answer, int):
            assert task.verify(problem, f"Answer: {answer:,}") == 1.0
            assert task.verify(problem, f"Answer: {answer + 1}") == 0.0
        else:
            assert task.verify(problem, f"Answer: {answer.upper()}") == 1.0
            other = next(c for c in ("Lisbon", "Oslo") if c != answer)
            assert task.verify(problem, f"Answer: {other}") == 0.0


def _solve_tables_by_hand(tables, query):
    """An independent solver: nested loops over the rows, no dictionaries shared with the task's solver."""
    def city_of(employee):
        for dept in tables["departments"]:
            if dept["department"] == employee["department"]:
                return dept["city"]

    def employee(name):
        return next(e for e in tables["employees"] if e["name"] == name)

    kind = query["kind"]
    if kind == "city_of":
        return city_of(employee(query["employee"]))
    if kind == "manager_salary":
        dept = next(d for d in tables["departments"] if d["department"] == employee(query["employee"])["department"])
        return employee(dept["manager"])["salary"]
    in_city = [e for e in tables["employees"] if city_of(e) == query.get("city")]
    if kind == "city_total_salary":
        return sum(e["salary"] for e in in_city)
    if kind == "city_count_older":
        return len([e for e in in_city if e["age"] > query["age"]])
    cities = {d["city"] for d in tables["departments"]}
    return max(cities, key=lambda c: sum(e["salary"] for e in tables["employees"] if city_of(e) == c))


def test_math():
    import sympy

    task = tasks.get("math")
    x = sympy.Symbol("x")
    for difficulty, seed in itertools.product(_levels(task), range(5)):
        problem = task.generate(seed, difficulty)
        kind, expr = problem.data["kind"], problem.data["expr"]
        # Reference solver: sympy on the structured problem, answered in a different but equal form.
        if kind == "fraction":
            value = sympy.nsimplify(sympy.sympify(expr))
            answers, wrong = [str(value), f"\\frac{{{value.p * 2}}}{{{value.q * 2}}}"], str(value + 1)
        elif kind == "linear":
            left, right = expr.split("=")
            (value,) = sympy.solve(sympy.sympify(left) - sympy.sympify(right), x)
            answers, wrong = [f"x = {value}", str(value)], str(value + sympy.Rational(1, 2))
        elif kind == "expand":
            product = sympy.sympify(expr)
            answers, wrong = [sympy.latex(sympy.expand(product)), sympy.latex(product)], sympy.latex(product + 1)
        elif kind == "roots":
            roots = sorted(sympy.solve(sympy.sympify(expr), x))
            answers = [f"{roots[1]}, {roots[0]}", f"x = {roots[0]}, x = {roots[1]}"]
            wrong = f"{roots[0]}"
        else:
            integrand, upper = expr.split("|")
            value = sympy.integrate(sympy.sympify(integrand), (x, 0, int(upper)))
            answers, wrong = [str(value), sympy.latex(value)], str(value - 1)
        for answer in answers:
            assert task.verify(problem, f"Answer: {answer}") == 1.0, (problem.prompt, answer)
        assert task.verify(problem, f"so it is \\boxed{{{answers[0]}}}") == 1.0
        assert task.verify(problem, f"Answer: {wrong}") == 0.0, (problem.prompt, wrong)
        assert task.verify(problem, "no answer") == 0.0


def test_rng_is_per_instance():
    # Generating one problem must not depend on what was generated before (reproducible datasets).
    task = tasks.get("sudoku")
    first = task.generate(5, 2)
    random.seed(123)
    task.generate(6, 2)
    assert task.generate(5, 2) == first
