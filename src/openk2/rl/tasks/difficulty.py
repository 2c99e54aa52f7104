"""Difficulty filter (report 3.2.1, "moderate difficulty"): estimate each problem's pass rate under the current
model from `num_samples` samples and keep the problems it solves sometimes but not always.

Problems the model always solves teach nothing; problems it never solves give no reward signal (and with a
group-mean baseline, zero advantage for every sample).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from openk2.llm.base import ChatModel
from openk2.rl.tasks.base import Problem, Task


@dataclass
class PassEstimate:
    """`num_correct` of `num_samples` responses verified correct for one problem."""

    problem: Problem
    num_samples: int
    num_correct: int

    @property
    def rate(self) -> float:
        return self.num_correct / self.num_samples

    def pass_at_k(self, k: int) -> float:
        """The unbiased pass@k estimate from these samples."""
        return pass_at_k(self.num_samples, self.num_correct, k)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021, Codex).

    >>> pass_at_k(10, 0, 1), pass_at_k(10, 10, 1), round(pass_at_k(4, 1, 2), 3)
    (0.0, 1.0, 0.5)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def estimate_pass_rates(task: Task, problems: Iterable[Problem], model: ChatModel, num_samples: int = 8,
                        threshold: float = 1.0, **sampling: Any) -> list[PassEstimate]:
    """Sample `num_samples` responses per problem and count those with reward >= `threshold`."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    sampling = {"temperature": 1.0, "max_tokens": task.max_tokens} | sampling
    estimates = []
    for problem in tqdm(list(problems), desc=f"pass rates ({task.name})", unit="problem"):
        responses = model.chat([{"role": "user", "content": problem.prompt}], n=num_samples, **sampling)
        correct = sum(task.verify(problem, r.content or "") >= threshold for r in responses)
        estimates.append(PassEstimate(problem, len(responses), correct))
    return estimates


def keep_moderate(estimates: Iterable[PassEstimate], low: float = 0.1, high: float = 0.9) -> list[Problem]:
    """The problems whose pass rate lies in [low, high] and that are neither always nor never solved."""
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"need 0 <= low <= high <= 1, got low={low}, high={high}")
    return [e.problem for e in estimates if 0 < e.num_correct < e.num_samples and low <= e.rate <= high]
