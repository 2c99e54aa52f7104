"""Any verifiable RL task (`openk2.rl.tasks`) as a benchmark on held-out seeds: math, GSM-Symbolic, instructions.

Each sample is one generated problem, asked in a single user turn; the score is the task's own verifier,
`task.verify(problem, response_text)`, so the benchmark grades exactly what RL rewards.

Held-out seeds: RL draws every generation seed with `random.Random(...).randrange(2**31)` (training groups,
the warm-up, the pre-training mix and the trainer's held-out evaluation problems alike), so all of them lie in
[0, 2**31). The benchmark's i-th problem uses seed `EVAL_SEED_BASE + i` with `EVAL_SEED_BASE = 2**31`: a seed
RL never uses. (A task with few distinct problems, such as level-1 arithmetic, can still produce the same
*problem* from two seeds; only the seed streams are disjoint.) A problem identical to an earlier one (same
prompt and data) is skipped, and without a fixed `difficulty` the levels cycle 1, 2, ..., num_difficulties.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from collections.abc import Callable
from typing import Any

from openk2.eval.base import Benchmark, EvalContext, Sample, ScriptedChatModel, Verdict
from openk2.llm.base import ChatModel
from openk2.rl import tasks
from openk2.rl.tasks.base import Problem, Task

EVAL_SEED_BASE = 2**31  # above every seed RL draws (randrange(2**31))
_MAX_TRIES_PER_PROBLEM = 100  # seeds tried per wanted problem before giving up on finding distinct ones
# Tasks whose verifier returns exactly 0 or 1 (the rest, e.g. code pass rates and reasoning-gym's partial
# credit, are fractional).
_BINARY = {"arithmetic", "math", "game24", "sudoku", "cryptarithm", "morse", "tables", "instruction",
           "faithfulness", "safety"}
# Reasoning-gym datasets graded as exact match although their scorer gives partial credit (gsm_symbolic
# gives 0.01 for any wrong number; GSM-Symbolic itself reports exact-match accuracy).
_EXACT = {"rg:gsm_symbolic"}
_NEEDS_JUDGE = {"faithfulness", "safety"}


class TaskBenchmark(Benchmark):
    """`num` held-out problems of RL task `task` (any name `openk2.rl.tasks.get` accepts, `rg:<dataset>` too),
    at `difficulty` or at every level in turn; `task_kwargs` go to the task's constructor."""

    def __init__(self, task: str, bench_name: str | None = None, difficulty: int | None = None, num: int = 100,
                 **task_kwargs: Any) -> None:
        if num < 1:
            raise ValueError(f"num must be >= 1, got {num}")
        if difficulty is not None and difficulty < 1:
            raise ValueError(f"difficulty must be >= 1, got {difficulty}")
        self.task_name, self.task_kwargs = task, task_kwargs
        self.difficulty, self.num = difficulty, num
        self.name = bench_name or f"rl:{task}"
        self.exact = task in _EXACT
        self.binary = task in _BINARY or self.exact
        self.metric = "accuracy" if self.binary else "mean reward"
        level = f"difficulty {difficulty}" if difficulty else "every difficulty in turn"
        self.description = f"RL task {task}: {num} held-out problems ({level}), scored by its verifier"
        self._task: Task | None = None  # built on first use: reasoning-gym alone takes seconds to import
        self._problems: list[Problem] = []
        self._seed_cursor = 0  # next seed offset to try
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._judged: tuple[ChatModel, Task] | None = None  # (judge, the task built with it) for verifying

    @property
    def task(self) -> Task:
        """The RL task (built on first use; an unknown name or a bad difficulty raises ValueError here)."""
        if self._task is None:
            task = tasks.get(self.task_name, **self.task_kwargs)
            if self.difficulty is not None:
                task._check_difficulty(self.difficulty)
            self._task = task
        return self._task

    # ------------------------------------------------------------------------------------------ samples
    def _generate_up_to(self, count: int) -> None:
        """Extend the cached problem list to `count` distinct problems (a deterministic prefix)."""
        levels = [self.difficulty] if self.difficulty else list(range(1, self.task.num_difficulties + 1))
        budget = count * _MAX_TRIES_PER_PROBLEM
        while len(self._problems) < count:
            if self._seed_cursor >= budget:
                raise ValueError(f"task {self.task_name} has fewer than {count} distinct problems at "
                                 f"difficulty {self.difficulty or 'any'}; lower num")
            offset = self._seed_cursor
            self._seed_cursor += 1
            problem = self.task.generate(EVAL_SEED_BASE + offset, levels[len(self._problems) % len(levels)])
            key = problem.prompt + json.dumps(problem.data, sort_keys=True, default=str)
            if key not in self._seen:
                self._seen.add(key)
                self._problems.append(problem)

    def samples(self, limit: int | None = None) -> list[Sample]:
        count = self.num if limit is None else min(limit, self.num)
        with self._lock:
            self._generate_up_to(count)
            problems = self._problems[:count]
        return [Sample(f"{i:04d}-d{p.difficulty}", {"seed": p.seed, "difficulty": p.difficulty})
                for i, p in enumerate(problems)]

    def problem(self, sample: Sample) -> Problem:
        """The generated problem behind `sample` (regenerated from its seed and difficulty)."""
        return self.task.generate(int(sample.data["seed"]), int(sample.data["difficulty"]))

    # ------------------------------------------------------------------------------------------ scoring
    def evaluate(self, model: ChatModel, sample: Sample, ctx: EvalContext) -> Verdict:
        verifier = self._verifier(ctx.judge)
        problem = self.problem(sample)
        try:
            response = model.chat([{"role": "user", "content": problem.prompt}], **ctx.sampling(sample.id))[0]
        except Exception as exc:  # a failing endpoint or malformed reply is the model's failure
            return Verdict(0.0, None, {"error": f"model call failed: {type(exc).__name__}: {exc}"})
        text = response.content or ""
        try:
            reward = float(verifier.verify(problem, text))
        except Exception as exc:  # a verifier choking on odd text (e.g. an unparsable formula) scores 0
            return Verdict(0.0, text, {"error": f"verifier failed: {type(exc).__name__}: {exc}"})
        score = float(reward >= 1.0) if self.exact else reward
        detail: dict[str, Any] = {"difficulty": problem.difficulty, "reward": reward}
        gold = _gold_hint(problem)
        if gold is not None:
            detail["expected"] = gold
        if score < 1.0 and not text.strip():
            detail["error"] = "empty response"
        return Verdict(score, text, detail)

    def check(self, ctx: EvalContext) -> None:
        if self.task_name in _NEEDS_JUDGE and ctx.judge is None:
            raise ValueError(f"benchmark {self.name} is graded by an LLM judge: give the run one (--judge SPEC)")

    def _verifier(self, judge: ChatModel | None) -> Task:
        """The task as built for verifying: with `judge` where the task takes one."""
        if self.task_name in _NEEDS_JUDGE and judge is None:
            raise ValueError(f"benchmark {self.name} is graded by an LLM judge: give the run a judge model "
                             "(EvalContext.judge)")
        if judge is None or "judge" not in inspect.signature(type(self.task)).parameters:
            return self.task
        with self._lock:
            if self._judged is None or self._judged[0] is not judge:
                self._judged = (judge, tasks.get(self.task_name, **{**self.task_kwargs, "judge": judge}))
            return self._judged[1]

    # ------------------------------------------------------------------------------------------ oracle
    def oracle(self, sample: Sample) -> ChatModel:
        """A model replaying a reference answer the task's verifier accepts (see `gold_response`)."""
        return ScriptedChatModel([gold_response(self.problem(sample), self.task_name)])


def gold_response(problem: Problem, task: str) -> str:
    """A response carrying `problem`'s reference answer in the task's answer format.

    Raises NotImplementedError for tasks with no answer to replay (safety replies are judged, not matched;
    user tasks whose data has no "answer").
    """
    if task.startswith("rg:"):
        return f"Answer: {problem.data['entry']['answer']}"
    builder = _GOLD.get(task)
    if builder is not None:
        return builder(problem.data)
    if "answer" in problem.data:
        return f"Answer: {problem.data['answer']}"
    raise NotImplementedError(f"task {task!r} has no reference answer to replay (its problem data has no 'answer')")


def _game24(data: dict[str, Any]) -> str:
    from openk2.rl.tasks.game24 import solve24

    return f"Answer: {solve24(data['numbers'])}"


def _sudoku(data: dict[str, Any]) -> str:
    from openk2.rl.tasks.sudoku import solve_sudoku

    return f"Answer: {solve_sudoku(data['puzzle'])}"


def _cryptarithm(data: dict[str, Any]) -> str:
    from openk2.rl.tasks.cryptarithm import solve_cryptarithm

    mapping = solve_cryptarithm(data["addends"], data["total"]) or {}
    return "Answer: " + ", ".join(f"{letter}={digit}" for letter, digit in sorted(mapping.items()))


def _instruction(data: dict[str, Any]) -> str:
    from openk2.rl.tasks.instruction import compose_response

    if any(c["kind"] == "judged" for c in data["constraints"]):
        raise NotImplementedError("a judged (tone/style) constraint has no reference note to replay")
    return "Answer:\n" + compose_response(data["topic"], data["constraints"])


def _faithfulness(data: dict[str, Any]) -> str:
    """The context's own sentences that state each asked fact about the asked town (supported by definition)."""
    sentences = [s.strip() + " " for s in re.split(r"(?<=\.)\s+", data["context"]) if s.strip()]
    asked_words = {w for w in re.findall(r"[A-Z][a-z]+", data["question"]) if len(w) > 2}
    chosen = []
    for answer in data["answers"]:
        stating = [s for s in sentences if answer.lower() in s.lower()]
        about_town = [s for s in stating if asked_words & set(re.findall(r"[A-Z][a-z]+", s))]
        chosen.append((about_town or stating or [answer + "."])[0].strip())
    return "Answer: " + " ".join(dict.fromkeys(chosen))


def _safety(data: dict[str, Any]) -> str:
    raise NotImplementedError("safety has no gold reply: whether a reply helps the attacker is judged, not matched")


_GOLD: dict[str, Callable[[dict[str, Any]], str]] = {
    "arithmetic": lambda d: f"Answer: {d['answer']}",
    "math": lambda d: f"Answer: {d['answer']}",
    "tables": lambda d: f"Answer: {d['answer']}",
    "morse": lambda d: f"Answer: {d['text']}",
    "code": lambda d: f"Answer:\n```python\n{d['reference']}```",
    "game24": _game24,
    "sudoku": _sudoku,
    "cryptarithm": _cryptarithm,
    "instruction": _instruction,
    "faithfulness": _faithfulness,
    "safety": _safety,
}


def _gold_hint(problem: Problem) -> Any:
    """The expected answer for the record, where the problem data states one plainly."""
    data = problem.data
    if "entry" in data:
        return data["entry"].get("answer")
    for key in ("answer", "answers", "text"):
        if key in data:
            return data[key]
    return None
