"""Coding episodes: the agent's code runs in the real sandbox, and the hidden tests' outcome feeds the rubric.

The report's agentic pipeline runs coding tasks in "real execution sandboxes" (section 3.1.1) and scores code
by the pass rate of unit tests (section 3.2.1). Here a coding episode offers two tools:

    run_code(code, stdin="")   runs a program in the candidate sandbox; answers exit code, stdout, stderr
    run_tests(code, tests="")  runs the task's hidden tests against the code in the judge sandbox (or, for a
                               task without hidden tests, the agent's own `tests`); answers per-test results

`CodeRunner` executes them for one episode through `openk2.agentic.sandbox.run_python` (bubblewrap, seccomp,
cgroups; docs/sandbox.md) off the event loop, and records every run. `code_verdict` turns the record into
the rubric's rule verdict: the last hidden-test run must pass every test. `coding_tasks` makes procedural
problems (five families, seeded) whose expected values come from our reference implementations.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from openk2.agentic.agents import Agent, Criterion, Rubric, Task
from openk2.agentic.tools import Tool

MAX_SHOWN = 4000  # characters of stdout/stderr handed back to the agent

_CODE = {"type": "string", "description": "The complete Python program (or function definitions)."}
CODE_TOOLS = [
    Tool(name="run_code", description="Run a Python program in an isolated sandbox and return its output.",
         parameters={"type": "object", "required": ["code"], "additionalProperties": False, "properties": {
             "code": _CODE, "stdin": {"type": "string", "description": "Text the program reads on stdin."}}},
         returns={"type": "object", "properties": {"exit_code": {"type": "integer"}, "stdout": {"type": "string"},
                                                   "stderr": {"type": "string"}}},
         source="synthetic", category="code", domain="coding", origin={"builtin": "openk2.agentic.coding"}),
    Tool(name="run_tests", description="Run the task's unit tests against your code in a sandbox.",
         parameters={"type": "object", "required": ["code"], "additionalProperties": False, "properties": {
             "code": _CODE, "tests": {"type": "string", "description": "Your own test functions (test_*), used "
                                                                       "only when the task has no tests."}}},
         returns={"type": "object", "properties": {"passed": {"type": "integer"}, "failed": {"type": "integer"}}},
         source="synthetic", category="code", domain="coding", origin={"builtin": "openk2.agentic.coding"}),
]

# Strict equality for the hidden tests, run in the judge sandbox on plain values: type and value, recursively.
_SAME = ("def _same(got, want):\n"
         "    if type(got) is not type(want):\n"
         "        return False\n"
         "    if type(want) in (list, tuple):\n"
         "        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))\n"
         "    return got == want\n\n\n")


@dataclass
class CodingProblem:
    """One function to write, with hidden tests (the judge sandbox runs them) and our reference solution."""

    function: str
    statement: str
    tests: str
    reference: str

    def to_dict(self) -> dict:
        return asdict(self)


def _dedupe(rng: random.Random) -> dict[str, Any]:
    return {"function": "dedupe",
            "statement": "Write `dedupe(xs)` returning the list `xs` without repeated values, keeping the first "
                         "occurrence of each in order.",
            "source": "def dedupe(xs):\n    out = []\n    for x in xs:\n        if x not in out:\n"
                      "            out.append(x)\n    return out\n",
            "inputs": [[[rng.randint(0, 6) for _ in range(rng.randint(0, 9))]] for _ in range(6)]}


def _word_lengths(rng: random.Random) -> dict[str, Any]:
    words = ["a", "sea", "tool", "agent", "kimi", "moon", "shot", "to", "of"]
    return {"function": "word_lengths",
            "statement": "Write `word_lengths(s)` returning the lengths of the whitespace-separated words of `s`.",
            "source": "def word_lengths(s):\n    return [len(w) for w in s.split()]\n",
            "inputs": [[" ".join(rng.choice(words) for _ in range(rng.randint(0, 6)))] for _ in range(6)]}


def _rotate(rng: random.Random) -> dict[str, Any]:
    return {"function": "rotate",
            "statement": "Write `rotate(xs, k)` returning the list `xs` rotated right by `k` places (k >= 0 may "
                         "exceed the length; an empty list stays empty).",
            "source": "def rotate(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n"
                      "    return xs[len(xs) - k:] + xs[:len(xs) - k]\n",
            "inputs": [[[rng.randint(0, 9) for _ in range(rng.randint(0, 6))], rng.randint(0, 9)] for _ in range(6)]}


def _balanced(rng: random.Random) -> dict[str, Any]:
    return {"function": "is_balanced",
            "statement": "Write `is_balanced(s)` returning True if the brackets ()[]{} in string `s` are balanced "
                         "and properly nested, else False.",
            "source": "def is_balanced(s):\n    pairs, stack = {')': '(', ']': '[', '}': '{'}, []\n"
                      "    for c in s:\n        if c in '([{':\n            stack.append(c)\n"
                      "        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n"
                      "                return False\n    return not stack\n",
            "inputs": [["".join(rng.choice("()[]{}x") for _ in range(rng.randint(0, 8)))] for _ in range(6)]}


def _second_largest(rng: random.Random) -> dict[str, Any]:
    return {"function": "second_largest",
            "statement": "Write `second_largest(xs)` returning the second largest distinct integer in `xs`, or "
                         "None when there is none.",
            "source": "def second_largest(xs):\n    d = sorted(set(xs))\n    return d[-2] if len(d) > 1 else None\n",
            "inputs": [[[rng.randint(-5, 5) for _ in range(rng.randint(0, 6))]] for _ in range(6)]}


FAMILIES: tuple[Callable[[random.Random], dict[str, Any]], ...] = (_dedupe, _word_lengths, _rotate, _balanced,
                                                                   _second_largest)


def coding_problem(seed: int, index: int) -> CodingProblem:
    """Problem `index` of the seeded sequence (families in turn, parameters and inputs drawn per index)."""
    family = FAMILIES[index % len(FAMILIES)](random.Random(f"{seed}:coding:{index}"))
    namespace: dict[str, Any] = {}
    exec(compile(family["source"], "<reference>", "exec"), namespace)  # noqa: S102 - our own reference code
    reference = namespace[family["function"]]
    tests = _SAME + "".join(
        f"def test_{i}():\n    assert _same({family['function']}({', '.join(map(repr, args))}), "
        f"{reference(*args)!r})\n" for i, args in enumerate(family["inputs"]))
    return CodingProblem(function=family["function"], statement=family["statement"], tests=tests,
                         reference=family["source"])


CODING_PROMPT = ("You are a careful Python programmer. Write the function the user asks for. Check it with "
                 "run_tests (the task's tests) and try things with run_code; both run in a sandbox. When the "
                 "tests pass, give the complete function in your final answer.")


def coding_tasks(seed: int, num_tasks: int, agent_id: str = "code0000") -> tuple[Agent, list[Task],
                                                                                  dict[str, CodingProblem]]:
    """A coding agent (run_code, run_tests), `num_tasks` tasks for it, and each task's hidden problem by task id."""
    if num_tasks < 0:
        raise ValueError(f"the number of coding tasks must be >= 0, got {num_tasks}")
    agent = Agent(agent_id=agent_id, system_prompt=CODING_PROMPT, tool_names=[t.name for t in CODE_TOOLS],
                  behaviour="thorough: checks results and explains what it did", domain="coding")
    tasks, problems = [], {}
    for k in range(num_tasks):
        problem = coding_problem(seed, k)
        task_id = f"{agent_id}-t{k}"
        rubric = Rubric(criteria=[Criterion("c1", "the final answer gives the complete requested function", True)],
                        expected_tools=["run_tests"], checkpoints=["the code passes the task's tests"])
        tasks.append(Task(task_id=task_id, agent_id=agent_id, difficulty="simple",
                          instruction=f"{problem.statement} Check it with the tests before you answer.",
                          rubric=rubric))
        problems[task_id] = problem
    return agent, tasks, problems


class CodeRunner:
    """Runs one episode's code tools in the sandbox and records each run; `problem` holds the hidden tests.

    `pool` is a `SandboxPool` shared by concurrent episodes (else each run takes a thread of its own);
    `limits` are `run_python` keyword arguments (timeout_s, memory_mb, ...)."""

    tool_names = tuple(t.name for t in CODE_TOOLS)

    def __init__(self, problem: CodingProblem | None = None, *, pool: Any = None, **limits: Any) -> None:
        self.problem = problem
        self.pool = pool
        self.limits = {"timeout_s": 10.0, "memory_mb": 256, **limits}
        self.runs: list[dict] = []

    async def _run(self, code: str, tests: str | None, **kwargs: Any) -> Any:
        from openk2.agentic.sandbox import run_python  # imported lazily: episodes without code tools skip it

        kwargs = {**self.limits, **kwargs}
        if self.pool is not None:
            return await self.pool.run(code, tests, **kwargs)
        return await asyncio.to_thread(run_python, code, tests, **kwargs)

    async def execute(self, name: str, args: dict) -> tuple[str, Any]:
        """(outcome, tool result) for a validated call of run_code or run_tests."""
        code = args["code"]
        record: dict[str, Any] = {"tool": name, "code_sha256": hashlib.sha256(code.encode("utf-8")).hexdigest()[:16],
                                  "code_chars": len(code), "hidden": False}
        if name == "run_code":
            got = await self._run(code, None, stdin=args.get("stdin", ""))
            result = {"exit_code": got.exit_code, "stdout": got.stdout[:MAX_SHOWN], "stderr": got.stderr[:MAX_SHOWN]}
            outcome = "code_ran" if got.killed_reason is None and got.error is None else "code_failed"
        else:
            if self.problem is not None:
                record["hidden"] = True
                got = await self._run(code, self.problem.tests, entry_points=[self.problem.function])
            elif args.get("tests", "").strip():
                got = await self._run(code, args["tests"])
            else:
                return "invalid_arguments", {"error": "invalid_arguments",
                                             "message": "this task has no tests of its own: pass your `tests`"}
            result = {"passed": got.passed, "failed": got.failed,
                      "tests": [{"name": t.name, "status": t.status, **({"error": t.error[:300]} if t.error else {})}
                                for t in got.tests[:50]]}
            outcome = "tests_passed" if got.ok and got.total > 0 else "tests_failed"
        if got.killed_reason:
            result["killed_reason"] = got.killed_reason[:300]
        if got.error:
            result["error"] = got.error[:MAX_SHOWN]
        record.update({"outcome": outcome, "passed": got.passed, "failed": got.failed, "exit_code": got.exit_code,
                       "killed_reason": got.killed_reason, "error": (got.error or "")[:500] or None,
                       "duration_s": round(got.duration_s, 3)})
        self.runs.append(record)
        return outcome, result

    def to_dict(self) -> dict:
        """What the trajectory records: the hidden problem's size and every run."""
        return {"function": self.problem.function if self.problem else None,
                "hidden_tests": self.problem.tests.count("\ndef test_") if self.problem else 0,
                "runs": [dict(r) for r in self.runs]}


def code_verdict(state: dict) -> tuple[bool, str] | None:
    """(passed, reason) for a trajectory whose task had hidden tests: its last hidden-test run passed them all;
    None when the task had none (nothing to check)."""
    code = state.get("code") if isinstance(state, dict) else None
    if not isinstance(code, dict) or not code.get("hidden_tests"):
        return None
    runs = [r for r in code.get("runs", []) if isinstance(r, dict) and r.get("hidden")]
    if not runs:
        return False, "the code was never run against the task's tests"
    last = runs[-1]
    passed = last.get("outcome") == "tests_passed"
    why = last.get("killed_reason") or last.get("error")
    return passed, (f"last test run: {last.get('passed', 0)} passed, {last.get('failed', 0)} failed"
                    + (f" ({str(why)[:200]})" if why else ""))
