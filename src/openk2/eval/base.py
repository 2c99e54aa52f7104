"""What every benchmark in `openk2.eval` implements: `Sample`, `Verdict`, `EvalContext` and `Benchmark`.

A benchmark lists its samples (deterministic order) and scores one sample by running a `ChatModel` on it,
single- or multi-turn, returning a `Verdict`: a score, the model's answer and why. The harness
(`openk2.eval.harness`) does everything else: concurrency, JSONL records, resume, aggregation with a confidence
interval, tables. `oracle(sample)` returns a `ChatModel` that replays the sample's ground truth, so
`--model oracle` runs the very same scoring path on gold answers (a self-test of scorers and environments).
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from openk2.llm.base import ChatModel


@dataclass
class Sample:
    """One benchmark item: a stable `id` and what the benchmark needs to pose and score it (JSON-serialisable)."""

    id: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Verdict:
    """The outcome of one sample. `score` is in [0, 1] for accuracy-like metrics (a raw value, e.g. a summed
    negative log-likelihood, where the benchmark's `aggregate` says so); `answer` is what the model produced
    (text, tool calls or a trajectory), `detail` says why (expected value, error kind, ...). Both JSON-serialisable."""

    score: float
    answer: Any = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalContext:
    """Settings shared by every sample of a run.

    `samples_per_problem` > 1 asks benchmarks that support it for pass@k (`k` <= samples_per_problem);
    `user_model` plays the user in multi-turn benchmarks (tau2) and `judge` grades where a rubric is needed;
    either may be None, in which case a benchmark uses the model under test or says it cannot run.
    """

    seed: int = 0
    temperature: float = 0.0
    max_tokens: int = 512
    samples_per_problem: int = 1
    k: int = 1
    user_model: ChatModel | None = None
    judge: ChatModel | None = None

    def sample_seed(self, sample_id: str) -> int:
        """A per-sample seed that depends only on the run seed and the sample id (not on order or concurrency)."""
        digest = hashlib.sha256(f"{self.seed}:{sample_id}".encode()).digest()
        return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF

    def sampling(self, sample_id: str, **overrides: Any) -> dict[str, Any]:
        """The sampling keywords for `ChatModel.chat` on this sample (seeded, so local and served runs agree)."""
        kw: dict[str, Any] = {"temperature": self.temperature, "max_tokens": self.max_tokens,
                              "seed": self.sample_seed(sample_id)}
        kw.update(overrides)
        return kw


@dataclass
class Aggregate:
    """A benchmark's headline number over `n` samples with a 95% confidence interval [low, high]."""

    value: float
    low: float
    high: float
    n: int


class Benchmark(ABC):
    """Subclasses set `name`, `description` (one line) and implement `samples` and `evaluate`.

    `metric` names the headline number; `binary` says scores are 0/1 (Wilson interval) rather than
    fractional (normal interval of the mean); `higher_is_better` orders runs in comparisons.
    """

    name: ClassVar[str] = "benchmark"
    description: ClassVar[str] = ""
    metric: ClassVar[str] = "accuracy"
    binary: ClassVar[bool] = True
    higher_is_better: ClassVar[bool] = True

    @abstractmethod
    def samples(self, limit: int | None = None) -> list[Sample]:
        """The benchmark's samples in a fixed order; `limit` keeps the first `limit` of them."""

    @abstractmethod
    def evaluate(self, model: ChatModel, sample: Sample, ctx: EvalContext) -> Verdict:
        """Run `model` on `sample` and score it. Never raises for a bad model answer: that is a score of 0."""

    def check(self, ctx: EvalContext) -> None:  # noqa: B027 - optional hook
        """Raise ValueError if this benchmark cannot run under `ctx` (a judge it needs is missing, k > n, ...);
        the harness calls it for every benchmark before loading any model."""

    def settings(self) -> dict[str, Any]:
        """What about this benchmark's setup affects comparability with published numbers (scorer, runner, step
        limits, prompts); recorded with the results, and a rerun under other settings is refused."""
        return {}

    def oracle(self, sample: Sample) -> ChatModel:
        """A ChatModel that answers `sample` with its ground truth."""
        raise NotImplementedError(f"{self.name} has no ground truth to replay")

    def aggregate(self, verdicts: Sequence[Verdict]) -> Aggregate:
        """The headline number: the mean score with a 95% interval."""
        scores = [v.score for v in verdicts]
        if self.binary:
            return wilson_interval(sum(scores), len(scores))
        return mean_interval(scores)


def wilson_interval(successes: float, n: int, z: float = 1.96) -> Aggregate:
    """Proportion `successes / n` with its Wilson score interval (sane at 0%, 100% and small n)."""
    if n == 0:
        return Aggregate(float("nan"), float("nan"), float("nan"), 0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return Aggregate(p, max(0.0, centre - half), min(1.0, centre + half), n)


def mean_interval(scores: Sequence[float], z: float = 1.96) -> Aggregate:
    """Mean of `scores` with a normal-approximation interval (mean +- z * standard error)."""
    n = len(scores)
    if n == 0:
        return Aggregate(float("nan"), float("nan"), float("nan"), 0)
    mean = sum(scores) / n
    if n == 1:
        return Aggregate(mean, mean, mean, 1)
    var = sum((s - mean) ** 2 for s in scores) / (n - 1)
    half = z * math.sqrt(var / n)
    return Aggregate(mean, mean - half, mean + half, n)


class ScriptedChatModel(ChatModel):
    """Replays a fixed list of assistant turns, one per `chat` call (the last one repeats once exhausted).

    Each turn is a `ChatResponse` or a plain string. Oracles are built from it.
    """

    def __init__(self, turns: Sequence[Any], name: str = "oracle") -> None:
        from openk2.llm.base import ChatResponse

        if not turns:
            raise ValueError("a scripted model needs at least one turn")
        self._turns = [t if isinstance(t, ChatResponse) else ChatResponse(content=str(t), finish_reason="stop")
                       for t in turns]
        self._next = 0
        self.name = name

    def chat(self, messages, tools=None, **sampling):
        turn = self._turns[min(self._next, len(self._turns) - 1)]
        self._next += 1
        return [turn] * int(sampling.get("n", 1) or 1)
