"""Math with symbolic answer checking: the answer is parsed and compared for equivalence with `math-verify`.

So ``3/4``, ``0.75`` and ``\\frac{6}{8}`` all match ``\\frac{3}{4}``; ``(x+2)(x+3)`` matches ``x^2+5x+6``;
``x = 2, x = -3`` matches the root set ``{-3, 2}``. Generated problems by difficulty:

1. fraction arithmetic   2. a linear equation   3. expand a product of binomials
4. the roots of a quadratic with integer roots   5. a definite integral of a quadratic

`data` is `{"kind", "expr" (sympy syntax), "answer" (LaTeX)}`.
"""

from __future__ import annotations

import logging
import random
import re
import threading
from fractions import Fraction

from openk2.rl.tasks.base import Problem, Task, extract_answer

_KINDS = {1: "fraction", 2: "linear", 3: "expand", 4: "roots", 5: "integral"}
_TIMEOUT_S = 5  # math-verify's own guard against pathological inputs; it needs signals (main thread only)


class MathTask(Task):
    name = "math"
    num_difficulties = len(_KINDS)
    max_tokens = 2048

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        difficulty = self._check_difficulty(difficulty)
        rng = random.Random(f"{self.name}:{seed}:{difficulty}")
        kind = _KINDS[difficulty]
        question, expr, answer = _GENERATORS[kind](rng)
        return self._problem(question, {"kind": kind, "expr": expr, "answer": answer}, seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        answer = extract_answer(response_text)
        if answer is None:
            return 0.0
        return float(equivalent(problem.data["answer"], answer))


def equivalent(gold_latex: str, answer: str) -> bool:
    """Whether `answer` (LaTeX or plain) is mathematically equal to `gold_latex`."""
    from math_verify import parse, verify

    timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    if timeout is None:  # its signal-based timeout only works in the main thread; it warns on every call without
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
    answer = answer if "$" in answer else f"${answer}$"  # math-verify reads bare text less reliably
    gold = parse(f"${gold_latex}$", parsing_timeout=timeout)
    target = parse(answer, parsing_timeout=timeout)
    return bool(gold and target and verify(gold, target, timeout_seconds=timeout))


def _tidy(text: str) -> str:
    """Conventional signs and coefficients: '+ -3' -> '- 3', '1x' -> 'x', '+ 0x' and '+ 0' dropped."""
    text = text.replace("+ -", "- ")
    text = re.sub(r"\b1x", "x", text)
    text = re.sub(r" [+-] 0x(\^\{?2\}?)?(?![\d^])", "", text)
    return re.sub(r" [+-] 0(?![\d.x])", "", text)


def _nonzero(rng: random.Random, low: int, high: int) -> int:
    return rng.choice([v for v in range(low, high + 1) if v != 0])


def _latex_fraction(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _fraction(rng: random.Random) -> tuple[str, str, str]:
    a, c = Fraction(rng.randint(1, 9), rng.randint(2, 9)), Fraction(rng.randint(1, 9), rng.randint(2, 9))
    op = rng.choice("+-*")
    value = {"+": a + c, "-": a - c, "*": a * c}[op]
    expr = f"({a}) {op} ({c})"
    return f"Compute {a} {op} {c} as a fraction in lowest terms.", expr, _latex_fraction(value)


def _linear(rng: random.Random) -> tuple[str, str, str]:
    a, c = rng.randint(2, 9), rng.randint(-9, 9)
    while c == a:
        c = rng.randint(-9, 9)
    b, d = rng.randint(-20, 20), rng.randint(-20, 20)
    equation = f"{a}*x + {b} = {c}*x + {d}"
    value = Fraction(d - b, a - c)
    return f"Solve for x: {a}x + {b} = {c}x + {d}.".replace("+ -", "- "), equation, _latex_fraction(value)


def _expand(rng: random.Random) -> tuple[str, str, str]:
    a, b, c, d = _nonzero(rng, 1, 5), _nonzero(rng, -9, 9), _nonzero(rng, 1, 5), _nonzero(rng, -9, 9)
    expr = f"({a}*x + {b})*({c}*x + {d})"
    x2, x1, x0 = a * c, a * d + b * c, b * d
    answer = f"{x2}x^{{2}} + {x1}x + {x0}".replace("+ -", "- ")
    shown = _tidy(expr.replace("*x", "x").replace(")*(", ")("))
    return f"Expand {shown}.", expr, _tidy(answer)


def _roots(rng: random.Random) -> tuple[str, str, str]:
    r1, r2 = rng.sample([v for v in range(-9, 10)], 2)
    b, c = -(r1 + r2), r1 * r2
    expr = f"x**2 + {b}*x + {c}"
    shown = _tidy(f"x^2 + {b}x + {c} = 0")
    answer = ", ".join(str(r) for r in sorted((r1, r2)))
    return f"Find all real solutions of {shown}. List them separated by commas.", expr, answer


def _integral(rng: random.Random) -> tuple[str, str, str]:
    a, b, c, upper = rng.randint(1, 6), rng.randint(-6, 6), rng.randint(-6, 6), rng.randint(1, 4)
    value = Fraction(a, 3) * upper ** 3 + Fraction(b, 2) * upper ** 2 + c * upper
    expr = f"{a}*x**2 + {b}*x + {c}"
    shown = _tidy(f"{a}x^2 + {b}x + {c}")
    return f"Compute the integral of {shown} dx from x = 0 to x = {upper}.", f"{expr}|{upper}", _latex_fraction(value)


_GENERATORS = {"fraction": _fraction, "linear": _linear, "expand": _expand, "roots": _roots, "integral": _integral}
