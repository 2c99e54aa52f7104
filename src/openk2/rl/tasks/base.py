"""What every verifiable task shares: the `Problem` record, the `Task` interface and the answer convention.

Answer convention (one for all tasks, stated in every prompt by `with_answer_instruction`): the final answer
is the text after the last ``Answer:`` in the response, up to the end of that line. A response without one
falls back to the last ``\\boxed{...}``, since math-tuned models write that out of habit. Reasoning before
the answer is free-form and never graded.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

ANSWER_INSTRUCTION = 'Finish with a last line of the form "Answer: <your answer>".'

_ANSWER_RE = re.compile(r"\banswer\s*:[ \t]*(.*)", re.IGNORECASE)


@dataclass
class Problem:
    """One generated instance: `prompt` is what the policy sees, `data` is what the verifier needs."""

    prompt: str
    data: dict[str, Any] = field(default_factory=dict)
    task: str = ""
    seed: int = 0
    difficulty: int = 1


class Task(ABC):
    """A generator with difficulty levels `1..num_difficulties` and a verifier returning a reward in [0, 1].

    `max_tokens` is the task's response budget (report 3.2.2, budget control): rollouts sample at most this
    many tokens and `openk2.rl.loss.budget_penalty` penalises responses that hit it.
    """

    name: str = "task"
    num_difficulties: int = 5
    max_tokens: int = 1024
    answer_instruction: str = ANSWER_INSTRUCTION  # the convention as worded for this task's answers

    @abstractmethod
    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        """A problem, deterministic in (seed, difficulty)."""

    @abstractmethod
    def verify(self, problem: Problem, response_text: str) -> float:
        """The reward of `response_text` for `problem`, in [0, 1]."""

    def _check_difficulty(self, difficulty: int) -> int:
        if not 1 <= int(difficulty) <= self.num_difficulties:
            raise ValueError(f"{self.name}: difficulty must be in 1..{self.num_difficulties}, got {difficulty}")
        return int(difficulty)

    def _problem(self, prompt: str, data: dict[str, Any], seed: int, difficulty: int) -> Problem:
        prompt = with_answer_instruction(prompt, self.answer_instruction)
        return Problem(prompt=prompt, data=data, task=self.name, seed=seed, difficulty=difficulty)


def with_answer_instruction(prompt: str, instruction: str = ANSWER_INSTRUCTION) -> str:
    """`prompt` followed by the answer-format instruction."""
    return f"{prompt.rstrip()}\n{instruction}"


def extract_answer(text: str | None, multiline: bool = False) -> str | None:
    """The final answer in `text` by the shared convention, or None if there is none.

    With `multiline` the answer runs to the end of the text (grids and other multi-line answers).

    >>> extract_answer("2 + 2 is four.\\nAnswer: 4")
    '4'
    >>> extract_answer("so the result is \\\\boxed{\\\\frac{1}{2}}.")
    '\\\\frac{1}{2}'
    """
    if not text:
        return None
    matches = list(_ANSWER_RE.finditer(text))
    if matches:
        last = matches[-1]
        if multiline:  # a grid or a whole note: keep it as written
            return text[last.start(1):].strip() or None
        answer = last.group(1).strip()
        # A model that writes "Answer: $\boxed{7}$" means 7.
        boxed = last_boxed(answer)
        answer = boxed if boxed is not None else answer
        return answer.strip().strip("$").strip().rstrip(".").strip() or None
    return last_boxed(text)


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` in `text` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip()
    return None

