"""Cryptarithms: letters stand for distinct digits in an addition such as ``SEND + MORE = MONEY``.

`data` is `{"addends": [...], "total": str}`. The answer is the letter mapping, e.g. ``A=1, B=7, C=0``.
Any mapping that makes the sum true scores 1.0 (distinct digits per letter, no leading zero in a
multi-digit word). Difficulty sets the number of addends and their length.
"""

from __future__ import annotations

import random
import re
import string

from openk2.rl.tasks.base import Problem, Task, extract_answer

_LEVELS = {1: (2, 2), 2: (2, 3), 3: (2, 4), 4: (3, 3), 5: (3, 4)}  # addends, digits each
_PAIR_RE = re.compile(r"([A-Z])\s*=\s*(\d)")


class CryptarithmTask(Task):
    name = "cryptarithm"
    num_difficulties = len(_LEVELS)
    max_tokens = 4096

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        difficulty = self._check_difficulty(difficulty)
        num_addends, num_digits = _LEVELS[difficulty]
        rng = random.Random(f"{self.name}:{seed}:{difficulty}")
        numbers = [rng.randint(10 ** (num_digits - 1), 10 ** num_digits - 1) for _ in range(num_addends)]
        letters = rng.sample(string.ascii_uppercase, 10)  # digit d is written letters[d]

        def spell(n: int) -> str:
            return "".join(letters[int(d)] for d in str(n))

        addends, total = [spell(n) for n in numbers], spell(sum(numbers))
        prompt = (f"Solve the cryptarithm {' + '.join(addends)} = {total}. Each letter stands for a different "
                  "digit and no number starts with 0. Give the letter values, e.g. A=1, B=2.")
        return self._problem(prompt, {"addends": addends, "total": total}, seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        answer = extract_answer(response_text)
        if answer is None:
            return 0.0
        mapping: dict[str, int] = {}
        for letter, digit in _PAIR_RE.findall(answer.upper()):
            if mapping.setdefault(letter, int(digit)) != int(digit):
                return 0.0  # one letter given two values
        return float(is_solution(problem.data["addends"], problem.data["total"], mapping))


def is_solution(addends: list[str], total: str, mapping: dict[str, int]) -> bool:
    """Whether `mapping` (letter -> digit) solves ``sum(addends) == total``."""
    words = [*addends, total]
    letters = {c for w in words for c in w}
    if not letters <= mapping.keys():
        return False
    used = [mapping[c] for c in letters]
    if len(set(used)) != len(used) or any(len(w) > 1 and mapping[w[0]] == 0 for w in words):
        return False

    def value(word: str) -> int:
        return int("".join(str(mapping[c]) for c in word))

    return sum(map(value, addends)) == value(total)


def solve_cryptarithm(addends: list[str], total: str) -> dict[str, int] | None:
    """A solving mapping, or None: column-by-column backtracking from the units digit, carrying as we go."""
    width = max(len(w) for w in [*addends, total])
    leading = {w[0] for w in [*addends, total] if len(w) > 1}
    mapping: dict[str, int] = {}

    def digit_options(letter: str) -> list[int]:
        if letter in mapping:
            return [mapping[letter]]
        taken = set(mapping.values())
        return [d for d in range(10) if d not in taken and not (d == 0 and letter in leading)]

    def column(k: int, carry: int) -> bool:
        if k == width:
            return carry == 0
        column_letters = [w[-1 - k] for w in addends if k < len(w)]
        return assign(column_letters, 0, k, carry)

    def assign(column_letters: list[str], partial: int, k: int, carry: int) -> bool:
        if column_letters:
            letter, rest = column_letters[0], column_letters[1:]
            for d in digit_options(letter):
                fresh = letter not in mapping
                mapping[letter] = d
                if assign(rest, partial + d, k, carry):
                    return True
                if fresh:
                    del mapping[letter]
            return False
        s = partial + carry
        if k >= len(total):
            return False
        target = total[-1 - k]
        if s % 10 not in digit_options(target):
            return False
        fresh = target not in mapping
        mapping[target] = s % 10
        if column(k + 1, s // 10):
            return True
        if fresh:
            del mapping[target]
        return False

    return dict(mapping) if column(0, 0) else None
