"""Coding: write a Python function; the reward is the pass rate of hidden unit tests run in the sandbox.

Five problem families, one per difficulty level, each with random parameters and random test inputs; the
expected outputs come from our reference implementation (`reference_solution`). The code runs in
`openk2.agentic.sandbox.run_python`'s candidate sandbox and the tests in its judge sandbox, which calls the
entry point across a pipe and compares the plain results with a strict type-and-value check (`_same`): the
code cannot reach the tests, the comparison or the reward (docs/sandbox.md).
The answer is the code after ``Answer:``, fenced or not; a response without ``Answer:`` falls back to its
last fenced code block.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from openk2.rl.tasks.base import Problem, Task, extract_answer

# The tests compare type and value, recursively: `True` is not 1, 1.0 is not 1, a tuple is not a list. They run
# in the judge sandbox on plain values received from the code's sandbox (docs/sandbox.md), so no object of the
# code, and none of its `__eq__`, takes part.
_STRICT_EQUAL = (
    "def _same(got, want):\n"
    "    if type(got) is not type(want):\n"
    "        return False\n"
    "    if type(want) in (list, tuple):\n"
    "        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))\n"
    "    if type(want) is dict:\n"
    "        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)\n"
    "    return got == want\n\n\n")
_FENCE_RE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_NUM_TESTS = 6


def _sum_multiples(rng: random.Random) -> dict[str, Any]:
    k = rng.randint(2, 7)
    return {"function": "sum_multiples",
            "statement": f"Write `sum_multiples(xs)` returning the sum of the integers in list `xs` divisible by {k}.",
            "source": f"def sum_multiples(xs):\n    return sum(x for x in xs if x % {k} == 0)\n",
            "inputs": [[rng.sample(range(-30, 60), rng.randint(0, 8))] for _ in range(_NUM_TESTS)]}


def _count_char(rng: random.Random) -> dict[str, Any]:
    char = rng.choice("aeiours")
    alphabet = "abcdeiorsuAEIORSU xyz"
    return {"function": "count_char",
            "statement": f"Write `count_char(s)` returning how many times the letter '{char}' occurs in string `s`, "
                         "ignoring case.",
            "source": f"def count_char(s):\n    return s.lower().count({char!r})\n",
            "inputs": [["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))] for _ in range(_NUM_TESTS)]}


def _fizz(rng: random.Random) -> dict[str, Any]:
    a, b = rng.sample(range(2, 8), 2)
    return {"function": "fizz",
            "statement": f"Write `fizz(n)` returning a list for i = 1..n: 'AB' if i is divisible by both {a} and {b}, "
                         f"'A' if only by {a}, 'B' if only by {b}, else str(i).",
            "source": (f"def fizz(n):\n    out = []\n    for i in range(1, n + 1):\n"
                       f"        word = ('A' if i % {a} == 0 else '') + ('B' if i % {b} == 0 else '')\n"
                       "        out.append(word or str(i))\n    return out\n"),
            "inputs": [[rng.randint(0, 40)] for _ in range(_NUM_TESTS)]}


def _rle(rng: random.Random) -> dict[str, Any]:
    return {"function": "rle",
            "statement": "Write `rle(s)` returning the run-length encoding of string `s`: each run of a repeated "
                         "character becomes the character followed by the run length, e.g. rle('aaab') == 'a3b1'.",
            "source": ("def rle(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n"
                       "        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
                       "        out.append(s[i] + str(j - i))\n        i = j\n    return ''.join(out)\n"),
            "inputs": [["".join(rng.choice("aab") * rng.randint(1, 4) for _ in range(rng.randint(0, 5)))]
                       for _ in range(_NUM_TESTS)]}


def _lis(rng: random.Random) -> dict[str, Any]:
    return {"function": "lis_length",
            "statement": "Write `lis_length(xs)` returning the length of the longest strictly increasing subsequence "
                         "of the list of integers `xs`.",
            "source": ("def lis_length(xs):\n    best = []\n    for x in xs:\n"
                       "        best.append(1 + max([b for y, b in zip(xs, best) if y < x], default=0))\n"
                       "    return max(best, default=0)\n"),
            "inputs": [[[rng.randint(0, 20) for _ in range(rng.randint(0, 12))]] for _ in range(_NUM_TESTS)]}


_FAMILIES: dict[int, Callable[[random.Random], dict[str, Any]]] = {1: _sum_multiples, 2: _count_char, 3: _fizz,
                                                                   4: _rle, 5: _lis}


class CodeTask(Task):
    name = "code"
    num_difficulties = len(_FAMILIES)
    max_tokens = 2048
    answer_instruction = 'End your response with a line "Answer:" followed by the code in a ```python block.'

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 512):
        self.timeout_s, self.memory_mb = timeout_s, memory_mb

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        difficulty = self._check_difficulty(difficulty)
        family = _FAMILIES[difficulty](random.Random(f"{self.name}:{seed}:{difficulty}"))
        reference = _load(family["source"], family["function"])
        cases = [(args, reference(*args)) for args in family["inputs"]]
        tests = _STRICT_EQUAL + "".join(f"def test_{i}():\n    assert _same({family['function']}("
                                        f"{', '.join(map(repr, args))}), {expected!r})\n"
                                        for i, (args, expected) in enumerate(cases))
        data = {"function": family["function"], "tests": tests, "reference": family["source"]}
        return self._problem(family["statement"], data, seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        from openk2.agentic.sandbox import run_python  # imported lazily: rollouts without code tasks skip it

        code = extract_code(response_text)
        if code is None:
            return 0.0
        function = problem.data["function"]
        result = run_python(code, tests=problem.data["tests"], timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                            entry_points=[function])
        if result.killed_reason or result.total == 0:
            return 0.0
        return result.passed / result.total


def extract_code(response_text: str) -> str | None:
    """The program in a response: the answer's fenced block (or the answer itself), else the last fenced block."""
    answer = extract_answer(response_text, multiline=True)
    if answer is not None:
        fenced = _FENCE_RE.findall(answer)
        return fenced[0] if fenced else answer
    fenced = _FENCE_RE.findall(response_text or "")
    return fenced[-1] if fenced else None


def reference_solution(problem: Problem) -> str:
    """Our implementation for `problem` (the tests' expected values come from it)."""
    return problem.data["reference"]


def _load(source: str, function: str) -> Callable[..., Any]:
    namespace: dict[str, Any] = {}
    exec(compile(source, "<reference>", "exec"), namespace)  # noqa: S102 - our own reference code
    return namespace[function]
