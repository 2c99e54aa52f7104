"""The 24 game: combine four numbers with + - * / and parentheses to make 24, each number used once.

`data` is `{"numbers": [a, b, c, d]}`. The answer is an expression such as ``(8 - 2) * 4 * 1``; it is checked
exactly (Fractions), so ``8 / (3 - 8 / 3)`` counts. Every generated instance has a solution.
Difficulty widens the number range (1-6, 1-9, 1-13); level 4 draws from the 16 sets in 1-13 that can only be
solved through a fraction (e.g. 3 3 8 8: ``8 / (3 - 8 / 3)``).
"""

from __future__ import annotations

import functools
import itertools
import random
from fractions import Fraction

from openk2.rl.tasks.base import Problem, Task, extract_answer
from openk2.rl.tasks.expr import evaluate

TARGET = 24
_LARGEST = {1: 6, 2: 9, 3: 13}  # level -> largest number
# All multisets over 1..13 that are solvable, but not with integer intermediates (exhaustive search with
# `solve24`; tests/rl/tasks checks the claim).
FRACTION_ONLY = ((1, 3, 4, 6), (1, 4, 5, 6), (1, 5, 5, 5), (1, 6, 6, 8), (1, 8, 12, 12), (2, 2, 11, 11),
                 (2, 2, 13, 13), (2, 3, 5, 12), (2, 4, 10, 10), (2, 5, 5, 10), (2, 7, 7, 10), (3, 3, 7, 7),
                 (3, 3, 8, 8), (4, 4, 7, 7), (5, 5, 7, 11), (5, 7, 7, 11))


class Game24Task(Task):
    name = "game24"
    num_difficulties = len(_LARGEST) + 1
    max_tokens = 1024

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        difficulty = self._check_difficulty(difficulty)
        rng = random.Random(f"{self.name}:{seed}:{difficulty}")
        if difficulty in _LARGEST:
            numbers = [rng.randint(1, _LARGEST[difficulty]) for _ in range(4)]
            while solve24(numbers) is None:
                numbers = [rng.randint(1, _LARGEST[difficulty]) for _ in range(4)]
        else:
            numbers = rng.sample(rng.choice(FRACTION_ONLY), 4)
        shown = ", ".join(map(str, numbers))
        prompt = (f"Use the numbers {shown} exactly once each, with + - * / and parentheses, to make {TARGET}. "
                  "Give the expression as your answer.")
        return self._problem(prompt, {"numbers": numbers}, seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        answer = extract_answer(response_text)
        if answer is None:
            return 0.0
        answer = answer.split("=")[0]  # "(8-2)*4 = 24" is fine
        try:
            value, used = evaluate(answer)
        except ValueError:
            return 0.0
        return float(value == TARGET and sorted(used) == sorted(problem.data["numbers"]))


def solve24(numbers: list[int], integers_only: bool = False) -> str | None:
    """An expression over `numbers` equal to 24, or None (exhaustive over all ways to combine them)."""
    return _expressions(tuple(sorted(numbers)), integers_only).get(Fraction(TARGET))


@functools.lru_cache(maxsize=4096)
def _expressions(numbers: tuple[int, ...], integers_only: bool) -> dict[Fraction, str]:
    """Every value reachable from the multiset `numbers`, with one expression for each."""
    if len(numbers) == 1:
        return {Fraction(numbers[0]): str(numbers[0])}
    found: dict[Fraction, str] = {}
    indices = range(len(numbers))
    for size in range(1, len(numbers)):
        for left_idx in itertools.combinations(indices, size):
            left = tuple(numbers[i] for i in left_idx)
            right = tuple(numbers[i] for i in indices if i not in left_idx)
            for a, sa in _expressions(left, integers_only).items():
                for b, sb in _expressions(right, integers_only).items():
                    candidates = [(a + b, f"({sa} + {sb})"), (a - b, f"({sa} - {sb})"), (a * b, f"{sa} * {sb}")]
                    if b != 0:
                        candidates.append((a / b, f"{sa} / ({sb})"))
                    for value, text in candidates:
                        if not (integers_only and value.denominator != 1):
                            found.setdefault(value, text)
    return found
