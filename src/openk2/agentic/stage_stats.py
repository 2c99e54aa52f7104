"""Acceptance at every stage of a synthesis run, computed from what its stores hold on disk.

For domains, tools, agents, tasks, trajectories and judged: how many were asked for and how many came out
(the acceptance rate), why the rest were rejected (reasons bucketed by their wording, quoted values and numbers
elided), how many tools dedup dropped, how many tool calls were valid (the tool simulator's outcomes: a call to
an unknown tool or with arguments that fail the schema is invalid; timeouts and other injected faults are valid
calls), how many simulated-user replies `user_check` rejected and why (an episode whose user turn used up its
attempts ends `user_rejected`), and the throughput of this run (items and completion tokens per second, per
stage and role). Counts come from the stores, so a resumed run reports the whole run; seconds and tokens are
this process's.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from openk2.agentic.store import JsonlStore

INVALID_CALL_OUTCOMES = ("unknown_tool", "invalid_arguments")
NOT_CALL_OUTCOMES = ("simulator_fallback", "phrasing_rejected")  # counted per call, but not calls themselves
_SOURCES = {"real": "real_server", "real_error": "real_server", "code_ran": "sandbox", "code_failed": "sandbox",
            "tests_passed": "sandbox", "tests_failed": "sandbox", "timeout": "injected_fault",
            "rate_limited": "injected_fault", "unknown_tool": "rejected_call", "invalid_arguments": "rejected_call"}


def result_sources(outcomes: dict[str, int]) -> dict[str, int]:
    """Tool calls by what produced their result: the seeded world (ok, partial, edge cases, not_found, ...), a real
    MCP server, the sandbox, an injected timeout or rate limit, or a rejection of the call itself."""
    got: Counter = Counter()
    for outcome, n in outcomes.items():
        if outcome not in NOT_CALL_OUTCOMES:
            got[_SOURCES.get(outcome, "world")] += n
    return dict(got.most_common())
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|\b\d+(\.\d+)?\b")


def reason_bucket(reason: str, limit: int = 80) -> str:
    """A rejection reason without its specifics (quoted values, numbers), for counting alike reasons together."""
    first = reason.split(";")[0]
    return " ".join(_QUOTED.sub("_", first).split())[:limit]


def _rate(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _store(out: Path, name: str, key: str) -> list[dict]:
    path = out / name
    return list(JsonlStore(path, key).records()) if path.exists() else []


def stage_stats(out: str | Path, cfg: Any, *, seconds: dict[str, float], done: dict[str, int],
                usage: dict[str, dict], structured: dict[str, dict], counts: dict[str, int] | None = None,
                total_seconds: float = 0.0) -> dict[str, Any]:
    """Per-stage counts, acceptance rates, rejection reasons, dedup and tool-call validity, plus throughput."""
    out = Path(out)
    counts = counts or {}
    stages: dict[str, dict] = {}

    domain_recs = _store(out, "domains.jsonl", "category")
    produced = sum(len(r["domains"]) for r in domain_recs)
    asked = len(domain_recs) * cfg.tools.domains_per_category
    stages["domains"] = {"requests": len(domain_recs), "asked": asked, "produced": produced,
                         "acceptance_rate": _rate(produced, asked),
                         "rejections": dict(Counter(reason_bucket(r["failure"]) for r in domain_recs
                                                    if r.get("failure")).most_common())}

    tool_recs = _store(out, "synthetic.jsonl", "domain_id")
    kept = sum(len(r["tools"]) for r in tool_recs)
    rejected = sum(r.get("rejected", 0) for r in tool_recs)
    reasons = Counter(reason_bucket(x) for r in tool_recs for x in r.get("reasons", []))
    dropped = counts.get("tools_dropped_as_duplicates", 0)
    repo = _store(out, "tools.jsonl", "name")
    stages["tools"] = {"requests": len(tool_recs), "asked": len(tool_recs) * cfg.tools.tools_per_domain,
                       "proposed": kept + rejected, "valid": kept, "acceptance_rate": _rate(kept, kept + rejected),
                       "rejections": dict(reasons.most_common(12)), "dropped_as_duplicates": dropped,
                       "dedup_rate": _rate(dropped, kept + sum(r["source"] == "mcp" for r in repo)),
                       "repository": len(repo), "mcp": sum(r["source"] == "mcp" for r in repo)}

    agent_recs = _store(out, "agents.jsonl", "agent_id")
    from_model = sum(r.get("prompt_source", "model") == "model" for r in agent_recs)
    stages["agents"] = {"produced": len(agent_recs), "prompt_from_model": from_model,
                        "acceptance_rate": _rate(from_model, len(agent_recs)),
                        "rejections": {"system prompt fell back to the template": len(agent_recs) - from_model}
                        if from_model < len(agent_recs) else {}}

    task_recs = _store(out, "tasks.jsonl", "agent_id")
    tasks = [t for r in task_recs for t in r["tasks"]]
    asked = len(task_recs) * cfg.agents.tasks_per_agent
    instructions = Counter(" ".join(t["instruction"].lower().split()) for t in tasks)
    stages["tasks"] = {"requests": len(task_recs), "asked": asked, "produced": len(tasks),
                       "acceptance_rate": _rate(len(tasks), asked),
                       "duplicate_instructions": sum(n - 1 for n in instructions.values()),
                       "rejections": dict(Counter(reason_bucket(r["failure"]) for r in task_recs
                                                  if r.get("failure")).most_common())}

    traj_recs = _store(out, "trajectories.jsonl", "trajectory_id")
    outcomes: Counter = Counter()
    for r in traj_recs:
        outcomes.update(r.get("outcomes", {}))
    calls = sum(n for k, n in outcomes.items() if k not in NOT_CALL_OUTCOMES)
    invalid = sum(outcomes.get(k, 0) for k in INVALID_CALL_OUTCOMES)
    with_calls = sum(any(m.get("tool_calls") for m in r["messages"]) for r in traj_recs)
    coding = _store(out, "coding.jsonl", "task_id")  # coding tasks ([coding]) play episodes too
    asked = (len(tasks) + len(coding)) * cfg.simulate.trajectories_per_task
    user_rejections = Counter(f"user turn: {reason_bucket(x)}" for r in traj_recs for x in r.get("user_rejections", []))
    stages["trajectories"] = {"asked": asked, "produced": len(traj_recs),
                              "acceptance_rate": _rate(len(traj_recs), asked),
                              "user_turns_rejected": sum(user_rejections.values()),
                              "rejections": dict(user_rejections.most_common()), "with_tool_calls": with_calls,
                              "tool_calls": calls, "invalid_tool_calls": invalid,
                              "tool_call_validity": _rate(calls - invalid, calls),
                              "end_reasons": dict(Counter(r["end_reason"].split(":")[0] for r in traj_recs)),
                              "result_sources": result_sources(outcomes),
                              "tool_outcomes": dict(outcomes.most_common())}

    judged = _store(out, "judged.jsonl", "trajectory_id")
    accepted = sum(bool(j["accepted"]) for j in judged)
    stages["judged"] = {"judged": len(judged), "accepted": accepted, "acceptance_rate": _rate(accepted, len(judged)),
                        "rejections": dict(Counter(i for j in judged for i in j.get("failed_mandatory", []))
                                           .most_common()),
                        "model_skipped": sum(bool(j.get("model_skipped")) for j in judged)}  # a rule decided first

    throughput = {name: {"seconds": round(s, 1), "items": done.get(name, 0),
                         "items_per_minute": round(60 * done.get(name, 0) / s, 2) if s > 0 else None}
                  for name, s in seconds.items()}
    tokens = sum(int(u.get("completion_tokens", 0)) for u in usage.values())
    return {"stages": stages, "throughput": throughput, "usage": usage, "structured_output": structured,
            "completion_tokens": tokens, "seconds": round(total_seconds, 1),
            "tokens_per_second": round(tokens / total_seconds, 2) if total_seconds > 0 else None}


def stage_stats_on_disk(run_dir: str | Path) -> dict[str, Any]:
    """`stage_stats` of a run directory from its stores and config.json alone (an interrupted run: no
    throughput, no dedup count)."""
    import json

    from openk2.agentic.synth_config import SynthConfig

    run_dir = Path(run_dir)
    path = run_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{run_dir} holds no synthesis run (no config.json)")
    raw = json.loads(path.read_text())
    raw["run"]["concurrency"] = 1  # not kept in config.json; irrelevant to the counts
    return stage_stats(run_dir, SynthConfig.from_dict(raw), seconds={}, done={}, usage={}, structured={})
