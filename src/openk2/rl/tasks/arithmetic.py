"""Small integer arithmetic, easy enough for a tiny CPU-trained model (the RL loop's end-to-end task).

Difficulty sets the operand count, their size and the operators:

| level | operands | values  | operators |
|-------|----------|---------|-----------|
| 1     | 2        | 0..9    | + -       |
| 2     | 2        | 0..9    | + - *     |
| 3     | 3        | 0..9    | + - *     |
| 4     | 2        | 0..99   | + - *     |
| 5     | 3        | 0..99   | + - *     |

Prompt: ``"Compute 3+5.\\nFinish with ... Answer: <your answer>"``; the reward is 1.0 iff the answer is the
exact integer value (Python precedence: * before + -).
"""

from __future__ import annotations

import random
import re

from openk2.rl.tasks.base import Problem, Task, extract_answer
from openk2.rl.tasks.expr import evaluate

_LEVELS = {  # level -> (operand count, largest value, operators)
    1: (2, 9, "+-"),
    2: (2, 9, "+-*"),
    3: (3, 9, "+-*"),
    4: (2, 99, "+-*"),
    5: (3, 99, "+-*"),
}
_INT_RE = re.compile(r"^[+-]?\d[\d,]*$")


class ArithmeticTask(Task):
    name = "arithmetic"
    num_difficulties = len(_LEVELS)
    max_tokens = 64

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        difficulty = self._check_difficulty(difficulty)
        num_operands, largest, operators = _LEVELS[difficulty]
        rng = random.Random(f"{self.name}:{seed}:{difficulty}")
        expression = str(rng.randint(0, largest))
        for _ in range(num_operands - 1):
            expression += rng.choice(operators) + str(rng.randint(0, largest))
        value, _ = evaluate(expression)
        return self._problem(f"Compute {expression}.", {"expression": expression, "answer": int(value)},
                             seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        answer = parse_int(extract_answer(response_text))
        return float(answer is not None and answer == problem.data["answer"])


def parse_int(text: str | None) -> int | None:
    """`text` as an integer ("1,024" and "+7" allowed), or None if it is not one."""
    if text is None or not _INT_RE.match(text.strip()):
        return None
    return int(text.strip().replace(",", ""))
