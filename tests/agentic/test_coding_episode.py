"""Coding episodes: the agent's code runs in the real sandbox (bubblewrap), hidden tests feed the rubric, and
hostile programs cannot touch the episode runner."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

from openk2.agentic.coding import CODE_TOOLS, FAMILIES, CodeRunner, code_verdict, coding_problem, coding_tasks
from openk2.agentic.judge import judge_trajectory
from openk2.agentic.rollout import run_episode
from openk2.agentic.simulate import ToolSimulator
from openk2.agentic.users import PERSONAS, UserSimulator
from openk2.llm.base import ChatModel, ChatResponse
from tests.agentic.fake_models import ScriptedModel

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")


class ScriptedCoder(ChatModel):
    """An agent that makes the planned tool calls in order, then answers."""

    name = "coder"

    def __init__(self, calls: list[tuple[str, dict]]) -> None:
        self.plan = list(calls)

    def chat(self, messages, tools=None, **sampling):
        if self.plan:
            name, args = self.plan.pop(0)
            call = {"id": f"call_{len(messages)}", "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)}}
            return [ChatResponse(content=None, tool_calls=[call], finish_reason="tool_calls")]
        return [ChatResponse(content="Here is the function:\n```python\n...\n```", finish_reason="stop")]


def _episode(calls, problem, **limits):
    agent, tasks, _ = coding_tasks(0, 1)
    runner = CodeRunner(problem, **limits)
    sim = ToolSimulator(CODE_TOOLS, seed=0, episode_id="code-e", code=runner)
    user = UserSimulator(ScriptedModel(), PERSONAS[0], tasks[0].instruction)
    traj = asyncio.run(run_episode("code-e", agent, tasks[0], CODE_TOOLS, ScriptedCoder(calls), user, sim,
                                   PERSONAS[0], max_user_turns=1, max_agent_steps=len(calls) + 2))
    return traj, tasks[0]


def _results(traj):
    return [json.loads(m["content"]) for m in traj.messages if m["role"] == "tool"]


def test_reference_solutions_pass_their_hidden_tests_and_wrong_ones_fail():
    problems = [coding_problem(0, k) for k in range(len(FAMILIES))]
    assert len({p.function for p in problems}) == len(FAMILIES)
    for p in problems:
        runner = CodeRunner(p)
        good = asyncio.run(runner.execute("run_tests", {"code": p.reference}))
        bad = asyncio.run(runner.execute("run_tests", {"code": f"def {p.function}(*args):\n    return 0\n"}))
        assert good[0] == "tests_passed" and good[1]["passed"] == 6 and good[1]["failed"] == 0, (p.function, good)
        assert bad[0] == "tests_failed" and bad[1]["failed"] > 0, (p.function, bad)
    assert coding_problem(0, 2) == coding_problem(0, 2) and coding_problem(0, 2) != coding_problem(1, 2)


def test_test_outcomes_feed_the_rubric():
    problem = coding_problem(0, 0)
    wrong = {"code": "def dedupe(xs):\n    return xs\n"}
    fixed, task = _episode([("run_tests", wrong), ("run_tests", {"code": problem.reference})], problem)
    first, second = _results(fixed)
    assert first["failed"] > 0 and (second["passed"], second["failed"]) == (6, 0)
    runs = fixed.state["code"]["runs"]
    assert [r["outcome"] for r in runs] == ["tests_failed", "tests_passed"] and all(r["hidden"] for r in runs)
    assert fixed.state["code"]["hidden_tests"] == 6 and fixed.outcomes == {"tests_failed": 1, "tests_passed": 1}
    judged = asyncio.run(judge_trajectory(ScriptedModel(), task, fixed))
    assert judged.accepted and any(v.criterion_id == "code_tests" and v.passed for v in judged.verdicts)

    gave_up, _ = _episode([("run_tests", wrong)], problem)
    rejected = asyncio.run(judge_trajectory(ScriptedModel(), task, gave_up))  # the judge model passes everything
    assert not rejected.accepted and rejected.failed_mandatory == ["code_tests"]
    never_ran, _ = _episode([("run_code", {"code": "print(1)"})], problem)
    assert code_verdict(never_ran.state) == (False, "the code was never run against the task's tests")


def test_hostile_programs_do_not_affect_the_episode_runner():
    host_passwd = Path("/etc/passwd").read_text().splitlines()[0]
    hostile = [
        ("run_code", {"code": "print(open('/etc/passwd').read())"}),
        ("run_code", {"code": "import os\npid = os.fork()\nprint('forked', pid)"}),
        ("run_code", {"code": "while True:\n    pass"}),
        ("run_code", {"code": "print('x' * 10_000_000)"}),
        ("run_tests", {"code": "import os\nos.kill(os.getppid(), 9)\ndef dedupe(xs):\n    while True:\n"
                               "        pass\n"}),
        ("run_tests", {"code": coding_problem(0, 0).reference}),  # and the episode still works afterwards
    ]
    start = time.perf_counter()
    traj, _ = _episode(hostile, coding_problem(0, 0), timeout_s=3.0)
    seconds = time.perf_counter() - start
    passwd, fork, loop, flood, kill, honest = _results(traj)
    assert host_passwd not in json.dumps(passwd) and "No such file" in passwd["error"]
    assert "forked" not in fork["stdout"] and "denied" in (fork.get("error", "") + fork.get("killed_reason", ""))
    assert "time" in loop["killed_reason"]
    assert len(flood["stdout"]) <= 4000
    assert kill["passed"] == 0 and ("denied" in kill.get("error", "") or kill.get("killed_reason"))
    assert honest["passed"] == 6 and honest["failed"] == 0
    assert traj.end_reason != "agent_error" and traj.messages[-1]["role"] == "assistant"
    assert seconds < 60  # one wall clock per run: the loops were killed, not waited for
    assert [r["outcome"] for r in traj.state["code"]["runs"]][-1] == "tests_passed"


def test_run_tests_without_hidden_tests_uses_the_agents_own():
    runner = CodeRunner(None)
    outcome, result = asyncio.run(runner.execute("run_tests", {"code": "def f():\n    return 2\n",
                                                               "tests": "def test_f():\n    assert f() == 2\n"}))
    assert outcome == "tests_passed" and result["passed"] == 1
    assert asyncio.run(runner.execute("run_tests", {"code": "x = 1"}))[0] == "invalid_arguments"
    assert code_verdict({"code": runner.to_dict()}) is None  # no hidden tests: nothing for the rubric to check


class CoderOrScripted(ScriptedModel):
    """The scripted pipeline model, except that a coding agent submits our reference solution to run_tests."""

    def __init__(self, seed: int, num_tasks: int) -> None:
        super().__init__()
        self.solutions = {coding_problem(seed, k).statement: coding_problem(seed, k).reference
                          for k in range(num_tasks)}

    def _agent(self, messages, tools):
        if not any(t["function"]["name"] == "run_tests" for t in tools):
            return super()._agent(messages, tools)
        if any(m["role"] == "tool" for m in messages):
            return ChatResponse(content="Done: the function passes the tests.", finish_reason="stop")
        code = next(c for s, c in self.solutions.items() if any(s in str(m.get("content")) for m in messages))
        call = {"id": "call_t", "type": "function",
                "function": {"name": "run_tests", "arguments": json.dumps({"code": code})}}
        return ChatResponse(content=None, tool_calls=[call], finish_reason="tool_calls")


def _pipeline_cfg(num_tasks):
    from openk2.agentic.synth_config import SynthConfig

    return SynthConfig.from_dict({
        "tools": {"mcp_servers": [], "categories": ["robot control"], "domains_per_category": 1,
                  "tools_per_domain": 2, "embedding_dedup": False},
        "agents": {"num_agents": 1, "tools_per_agent": 2, "tasks_per_agent": 1},
        "simulate": {"max_user_turns": 1, "max_agent_steps": 4}, "coding": {"num_tasks": num_tasks, "timeout_s": 5},
        "run": {"seed": 0, "concurrency": 2}})


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_synth_pipeline_runs_coding_episodes_and_their_tests_decide(tmp_path):
    from openk2.agentic.pipeline import ROLES, SynthPipeline

    # The scripted agent calls every tool once with placeholder arguments: its code fails the hidden tests,
    # and although the judge model passes everything, the rule verdict rejects those trajectories.
    stats = SynthPipeline(_pipeline_cfg(2), tmp_path / "bad", {r: ScriptedModel() for r in ROLES}).run()
    assert stats["coding_tasks"] == 2 and stats["trajectories"] == 3  # 1 synthesized task + 2 coding tasks
    assert [r["problem"]["function"] for r in _lines(tmp_path / "bad" / "coding.jsonl")] == ["dedupe", "word_lengths"]
    assert stats["acceptance"]["accepted"] == 1 and stats["acceptance"]["rejections_by_item"] == {"code_tests": 2}
    trajectories = {t["task_id"]: t for t in _lines(tmp_path / "bad" / "trajectories.jsonl")}
    for task_id in ("code0000-t0", "code0000-t1"):
        runs = trajectories[task_id]["state"]["code"]["runs"]
        assert [r["tool"] for r in runs] == ["run_code", "run_tests"] and runs[1]["outcome"] == "tests_failed"
    world = trajectories["a0000-t0"]["state"]
    assert world["entities"] and world["calls"] and "code" not in world  # the world is recorded, no sandbox

    models = {r: CoderOrScripted(0, 2) for r in ROLES}
    good = SynthPipeline(_pipeline_cfg(2), tmp_path / "good", models).run()
    assert good["acceptance"]["accepted"] == 3 and good["tool_outcomes"]["tests_passed"] == 2
    sft = _lines(tmp_path / "good" / "sft.jsonl")
    assert sum(any(c["function"]["name"] == "run_tests" for m in r["messages"] for c in m.get("tool_calls") or [])
               for r in sft) == 2
