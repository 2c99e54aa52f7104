"""A compact critic prompt for small policies: the question, the two responses and a one-line verdict.

The rubric prompt (`critic.critic_messages`) is about 1,300 characters before the question and the responses:
more than the whole context of the CI-sized RL policy (`configs/rl-tiny.toml`: 256 positions and a 768-token
BPE fitted on arithmetic text). This format keeps only what a verdict on a checkable answer needs:

    Compute 3+5*2.
    A: 5*2=10
    3+10=13
    Answer: 13
    B: 3+5=8
    8*2=16
    Answer: 16
    Which response is right? Finish with a last line of the form "Answer: A" or "Answer: B".

The verdict follows the tasks' answer convention (the text after the last "Answer:"), so a policy warmed up on
"Answer: <n>" can already give one: the letter "A" or "B", or the final answer of exactly one of the two
responses, which names that response (a value that matches neither or both is no verdict); a reply without
an "Answer:" line is read from its last line. No rubric is
mandatory here, so a reply never reports violations; the hack penalties of `critic_loop.hack_flags` do not
depend on the critic and apply as they do with the rubric prompt.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from openk2.chat.template import IM_END
from openk2.rl.critic import CriticFormat, Rubric
from openk2.rl.tasks.base import ANSWER_INSTRUCTION, Problem, extract_answer
from openk2.rl.warmup import Example, chat_prompt, sft_example, worked_solution

MAX_RESPONSE_CHARS = 160  # each response is cut to this many characters (the tiny policy's answers are ~40)
QUESTION = 'Which response is right? Finish with a last line of the form "Answer: A" or "Answer: B".'


def question_text(prompt: str) -> str:
    """The problem's prompt without the tasks' answer-format instruction (the critic gets its own)."""
    text = prompt.rstrip()
    return text[: -len(ANSWER_INSTRUCTION)].rstrip() if text.endswith(ANSWER_INSTRUCTION) else text


def compact_prompt(prompt: str, first: str, second: str, max_chars: int = MAX_RESPONSE_CHARS) -> str:
    """The compact comparison of `first` (A) and `second` (B) as responses to `prompt`."""
    a, b = first.strip()[:max_chars], second.strip()[:max_chars]
    return f"{question_text(prompt)}\nA: {a}\nB: {b}\n{QUESTION}"


def compact_verdict(reply: str, first: str, second: str) -> str | None:
    """'A', 'B' or None from a compact critic reply: a letter, or the final answer of exactly one response.

    >>> compact_verdict("Answer: b", "Answer: 4", "Answer: 5"), compact_verdict("3+1=4\\nAnswer: 4", "Answer: 4", "5")
    ('B', 'A')
    >>> compact_verdict("Answer: 6", "Answer: 4", "Answer: 5") is None, compact_verdict("1+4=5\\n5", "4", "Answer: 5")
    (True, 'B')
    """
    said = extract_answer(reply)
    if said is None:  # no "Answer:" line: a bare last line is the verdict (small policies drop the prefix)
        lines = [line.strip() for line in reply.strip().splitlines() if line.strip()]
        said = lines[-1].rstrip(".").strip() if lines else None
    if not said:
        return None
    if said.upper() in ("A", "B"):
        return said.upper()
    matches = [side for side, text in (("A", first), ("B", second)) if extract_answer(text) == said]
    return matches[0] if len(matches) == 1 else None


class CompactFormat(CriticFormat):
    """`CriticFormat` with the compact prompt (rubrics are not shown) and the one-line verdict."""

    name = "compact"

    def __init__(self, max_chars: int = MAX_RESPONSE_CHARS) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars

    def messages(self, rubrics: Sequence[Rubric], prompt: str, first: str, second: str) -> list[dict]:
        """One user turn: the compact comparison."""
        return [{"role": "user", "content": compact_prompt(prompt, first, second, self.max_chars)}]

    def parse(self, reply: str, first: str, second: str) -> tuple[str | None, tuple[bool, bool]]:
        """The verdict letter (or None) and no mandatory violations."""
        return compact_verdict(reply, first, second), (False, False)


COMPACT_FORMAT = CompactFormat()


# ---------------------------------------------------------------------- worked verdicts for the warm-up
def slipped_solution(expression: str, rng: random.Random) -> str | None:
    """A worked solution with one slip: the solution of `expression` with one operand off by one, whose final
    answer differs from the right one (None when no such slip exists)."""
    operands = list(re.finditer(r"\d+", expression))
    right = extract_answer(worked_solution(expression))
    for match in rng.sample(operands, len(operands)):
        value = int(match.group())
        for slip in rng.sample([value - 1, value + 1], 2) if value > 0 else [value + 1]:
            wrong = worked_solution(expression[: match.start()] + str(slip) + expression[match.end():])
            if extract_answer(wrong) != right:
                return wrong
    return None


def verdict_example(problem: Problem) -> Example:
    """A worked compact verdict on an arithmetic `problem`: its worked solution against a slipped one, in an order
    chosen by the problem's seed, and the right letter (the verdict format taught before RL); the plain
    worked-solution example when no slip changes the answer."""
    rng = random.Random(problem.seed)
    right = worked_solution(problem.data["expression"])
    wrong = slipped_solution(problem.data["expression"], rng)
    if wrong is None:
        return sft_example(problem)
    first, second, letter = (right, wrong, "A") if rng.random() < 0.5 else (wrong, right, "B")
    prompt = chat_prompt(Problem(compact_prompt(problem.prompt, first, second)))
    return [(prompt, False), (f"Answer: {letter}{IM_END}", True)]


__all__ = ["COMPACT_FORMAT", "CompactFormat", "compact_prompt", "compact_verdict", "question_text",
           "slipped_solution", "verdict_example"]
