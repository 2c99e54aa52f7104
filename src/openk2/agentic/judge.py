"""The rubric judge and filter (report 3.1.1: "An LLM-based judge evaluates each trajectory against rubrics;
only trajectories meeting success criteria are kept").

Each trajectory gets a `Judgement`: one `Verdict` per rubric criterion from a judge model (structured JSON,
every criterion answered), plus checks that need no model and cannot be argued with: the episode ended with a
final answer, not an error, and (when the rubric says so) every expected tool was called. The judge's request
carries a JSON schema with one required entry per criterion id (`verdict_schema`), so under a grammar every
criterion is answered. A trajectory is accepted only if all mandatory items pass; a judge that cannot produce a
usable verdict rejects it, with the reason. When a mandatory rule check already failed, the outcome is decided
and the judge model is not asked (`ask_when_rejected=False`, the default): no model verdicts are recorded, and
`Judgement.model_skipped` says so (with `smollm2` in the CI-sized run this is most trajectories, whose forced call
went to another tool).
`AcceptanceStats` counts what was kept and why the rest was dropped.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from openk2.agentic.agents import Rubric, Task
from openk2.agentic.coding import code_verdict
from openk2.agentic.jsonout import JSON_INSTRUCTION, JSONStats, ask_structured
from openk2.agentic.rollout import Trajectory
from openk2.llm.base import ChatModel


@dataclass
class Verdict:
    criterion_id: str
    passed: bool
    mandatory: bool
    reason: str = ""
    by: str = "judge"  # "judge" (the model) or "rule" (a check without a model)


@dataclass
class Judgement:
    trajectory_id: str
    verdicts: list[Verdict]
    accepted: bool
    score: float  # fraction of all items passed
    failed_mandatory: list[str] = field(default_factory=list)
    model_skipped: bool = False  # a mandatory rule failed first, so the judge model was not asked

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict) -> Judgement:
        return cls(**{**record, "verdicts": [Verdict(**v) for v in record["verdicts"]]})


def rule_verdicts(trajectory: Trajectory, rubric: Rubric) -> list[Verdict]:
    """The checks that need no model: a final answer, no agent error, expected tools called."""
    last = trajectory.messages[-1] if trajectory.messages else {}
    final = (last.get("role") == "assistant" and not last.get("tool_calls")
             and bool(str(last.get("content") or "").strip()))
    verdicts = [
        Verdict("final_answer", final, True, "ends with a final assistant answer" if final else
                f"no final answer (ended: {trajectory.end_reason})", by="rule"),
        Verdict("no_agent_error", not trajectory.end_reason.startswith("agent_error"), True, trajectory.end_reason,
                by="rule"),
    ]
    called = set(trajectory.tool_calls())
    missing = [t for t in rubric.expected_tools if t not in called]
    verdicts.append(Verdict("expected_tools", not missing, rubric.expected_tools_mandatory,
                            f"never called: {', '.join(missing)}" if missing else "all expected tools called",
                            by="rule"))
    code = code_verdict(trajectory.state)  # a coding task: its hidden tests, run in the sandbox, decide
    if code is not None:
        verdicts.append(Verdict("code_tests", code[0], True, code[1], by="rule"))
    return verdicts


def _transcript(trajectory: Trajectory, limit: int = 6000) -> str:
    lines = []
    for m in trajectory.messages[1:]:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "; ".join(f"{c['function']['name']}({c['function']['arguments']})" for c in m["tool_calls"])
            lines.append(f"ASSISTANT: {m.get('content') or ''} [calls: {calls}]")
        else:
            lines.append(f"{m['role'].upper()}: {m.get('content') or ''}")
    text = "\n".join(lines)
    return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2:]


def verdict_schema(ids: list[str]) -> dict:
    """The JSON schema of a judge reply: {"verdicts": {ID: {"reason", "passed"}}} with every id required."""
    one = {"type": "object", "properties": {"reason": {"type": "string", "maxLength": 80},
                                            "passed": {"type": "boolean"}}, "required": ["reason", "passed"]}
    return {"type": "object", "properties": {"verdicts": {"type": "object", "properties": {i: one for i in ids},
                                                          "required": list(ids)}},
            "required": ["verdicts"]}


def _verdict_validator(ids: list[str]):
    def validate(value: Any) -> dict[str, dict]:
        if isinstance(value, dict) and isinstance(value.get("verdicts"), dict):  # keyed by id (the schema's shape)
            value = [{**v, "id": k} for k, v in value["verdicts"].items() if isinstance(v, dict)]
        if isinstance(value, dict) and isinstance(value.get("verdicts"), list):
            value = value["verdicts"]
        if not isinstance(value, list):
            raise ValueError('expected {"verdicts": [{"id": ..., "passed": true|false, "reason": ...}]}')
        got = {}
        for v in value:
            if isinstance(v, dict) and v.get("id") in ids and isinstance(v.get("passed"), bool):
                got[v["id"]] = v
        missing = [i for i in ids if i not in got]
        if missing:
            raise ValueError(f"give a verdict (with a boolean 'passed') for every criterion; missing: {missing}")
        return got
    return validate


async def judge_trajectory(model: ChatModel, task: Task, trajectory: Trajectory, *, stats: JSONStats | None = None,
                           max_attempts: int = 3, ask_when_rejected: bool = False, **sampling: Any) -> Judgement:
    """Score `trajectory` against `task.rubric` and decide whether it is kept; the judge model is asked only
    when every mandatory rule check passed (or `ask_when_rejected`)."""
    rubric = task.rubric
    verdicts = rule_verdicts(trajectory, rubric)
    ruled_out = [v.criterion_id for v in verdicts if v.mandatory and not v.passed]
    if ruled_out and not ask_when_rejected:
        return Judgement(trajectory_id=trajectory.trajectory_id, verdicts=verdicts, accepted=False,
                         score=sum(v.passed for v in verdicts) / len(verdicts), failed_mandatory=ruled_out,
                         model_skipped=True)
    criteria = [{"id": c.criterion_id, "criterion": c.description, "mandatory": c.mandatory} for c in rubric.criteria]
    prompt = (f"You are a strict judge of an AI assistant's tool-use trajectory.\nTask: {task.instruction}\n"
              f"Expected tool use: {', '.join(rubric.expected_tools)}\nCheckpoints: {json.dumps(rubric.checkpoints)}\n"
              f"Criteria: {json.dumps(criteria)}\nWorld state after the episode: "
              f"{json.dumps({k: trajectory.state.get(k) for k in ('created', 'changed', 'deleted')})[:1500]}\n"
              + (f"Code test runs (sandbox): {json.dumps(trajectory.state['code']['runs'][-3:])[:800]}\n"
                 if isinstance(trajectory.state.get("code"), dict) else "") +
              f"Transcript:\n{_transcript(trajectory)}\n\nFor every criterion decide if the trajectory meets it. "
              'Answer as JSON: {"verdicts": {"c1": {"reason": "...", "passed": true}}}. ' + JSON_INSTRUCTION)
    ids = [c.criterion_id for c in rubric.criteria]
    reply = await ask_structured(model, [{"role": "user", "content": prompt}], _verdict_validator(ids), stats=stats,
                                 schema=verdict_schema(ids), max_attempts=max_attempts, **sampling)
    got = reply.value if reply.ok else None
    if got is None:
        verdicts.append(Verdict("judge", False, True, f"the judge gave no usable verdict ({reply.reason}: "
                                f"{reply.error})"[:300], by="rule"))
    else:
        for c in rubric.criteria:
            v = got[c.criterion_id]
            verdicts.append(Verdict(c.criterion_id, v["passed"], c.mandatory, str(v.get("reason", ""))[:500]))
    failed = [v.criterion_id for v in verdicts if v.mandatory and not v.passed]
    score = sum(v.passed for v in verdicts) / len(verdicts)
    return Judgement(trajectory_id=trajectory.trajectory_id, verdicts=verdicts, accepted=not failed, score=score,
                     failed_mandatory=failed)


@dataclass
class AcceptanceStats:
    """How many trajectories were judged and kept, and which mandatory items the dropped ones failed."""

    judged: int = 0
    accepted: int = 0
    failed_items: Counter = field(default_factory=Counter)

    def add(self, judgement: Judgement) -> None:
        self.judged += 1
        self.accepted += judgement.accepted
        self.failed_items.update(judgement.failed_mandatory)

    def as_dict(self) -> dict[str, Any]:
        return {"judged": self.judged, "accepted": self.accepted, "rejected": self.judged - self.accepted,
                "acceptance_rate": round(self.accepted / self.judged, 4) if self.judged else None,
                "rejections_by_item": dict(self.failed_items.most_common())}
