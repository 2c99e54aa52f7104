"""τ²-bench's reward for one episode: the product of the components in the task's `reward_basis`.

- DB: the final DB equals the DB obtained by replaying the gold actions on a fresh one (hash of the sorted-key
  JSON dump). As in tau2, a task whose `actions` is null passes without a check; an empty list means "change
  nothing".
- COMMUNICATE: every `communicate_info` string occurs in some agent text, compared case-insensitively with commas
  removed (tau2 drops the commas of the message, so "1,093.34" said matches "1093.34" expected).
- NL_ASSERTION: an LLM judge (`EvalContext.judge`) decides each natural-language assertion; without a judge the
  component is skipped and recorded. ACTION and ENV_ASSERTION are not implemented and likewise skipped (neither
  occurs in the retail and airline bases, which are all the default [DB, COMMUNICATE]).

An episode that did not end normally (max steps, too many tool errors, an empty or failed turn) scores 0, as in
tau2; its components are still computed for the record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from openk2.agentic.jsonout import extract_json
from openk2.eval.tau2_env import DBFingerprint
from openk2.eval.tau2_episode import Episode
from openk2.llm.base import ChatModel

DEFAULT_BASIS = ("DB", "COMMUNICATE")

JUDGE_PROMPT = """You grade a customer service conversation against a list of statements.
For each statement decide whether the agent's behaviour in the conversation makes it true.
Reply with one JSON array holding one true or false per statement, in order, and nothing else.

<conversation>
{conversation}
</conversation>

<statements>
{statements}
</statements>"""


@dataclass
class Reward:
    """`value` is the product of the scored `components`; `skipped` names basis entries that were not scored and
    why; `checks` holds the per-item results (communicate strings, judged assertions)."""

    value: float
    components: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)


def _agent_texts(messages: Sequence[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "assistant" and m.get("content")]


def communicate_checks(infos: Sequence[str], messages: Sequence[dict]) -> list[dict]:
    """For each info string, whether some agent text contains it (case- and comma-insensitive)."""
    texts = [t.lower().replace(",", "") for t in _agent_texts(messages)]
    return [{"info": info, "met": any(info.lower().replace(",", "") in t for t in texts)} for info in infos]


def transcript(messages: Sequence[dict]) -> str:
    """The conversation as plain lines for a judge (tool calls by name and arguments, results cut to 300 chars)."""
    lines = []
    for m in messages:
        if m["role"] == "tool":
            lines.append(f"tool result: {m['content'][:300]}")
        elif m.get("tool_calls"):
            calls = ", ".join(f"{c['function'].get('name')}({c['function'].get('arguments')})" for c in m["tool_calls"])
            lines.append(f"agent calls: {calls}")
        else:
            lines.append(f"{'agent' if m['role'] == 'assistant' else 'customer'}: {m.get('content') or ''}")
    return "\n".join(lines)


def judge_assertions(judge: ChatModel, assertions: Sequence[str], messages: Sequence[dict],
                     sampling: dict[str, Any]) -> list[dict]:
    """Ask `judge` whether each assertion holds; an unreadable verdict counts as not met (with the reason)."""
    if not assertions:
        return []
    prompt = JUDGE_PROMPT.format(conversation=transcript(messages),
                                 statements="\n".join(f"{i + 1}. {a}" for i, a in enumerate(assertions)))
    [response] = judge.chat([{"role": "user", "content": prompt}], **{**sampling, "n": 1})
    try:
        verdicts = extract_json(response.content)
        if not isinstance(verdicts, list) or len(verdicts) != len(assertions):
            raise ValueError(f"expected a list of {len(assertions)} booleans")
    except ValueError as exc:
        return [{"assertion": a, "met": False, "error": f"unreadable judge reply: {exc}"} for a in assertions]
    return [{"assertion": a, "met": v is True} for a, v in zip(assertions, verdicts, strict=True)]


def score_episode(task: dict, episode: Episode, final: DBFingerprint, gold: DBFingerprint,
                  judge: ChatModel | None = None, judge_sampling: dict[str, Any] | None = None) -> Reward:
    """The reward of `episode` on `task` (see the module docstring)."""
    criteria = task.get("evaluation_criteria") or {}
    basis = list(criteria.get("reward_basis") or DEFAULT_BASIS)
    reward = Reward(1.0)
    for component in basis:
        if component == "DB":
            match = criteria.get("actions") is None or final.hash == gold.hash
            reward.components["DB"] = float(match)
            reward.checks["db"] = {"match": match, "changed": list(final.changed), "expected": list(gold.changed)}
            if not match:
                reward.reasons.append(f"final DB differs from the gold DB (changed {list(final.changed)}, "
                                      f"expected {list(gold.changed)})")
        elif component == "COMMUNICATE":
            checks = communicate_checks(criteria.get("communicate_info") or [], episode.messages)
            reward.components["COMMUNICATE"] = float(all(c["met"] for c in checks))
            reward.checks["communicate"] = checks
            missing = [c["info"] for c in checks if not c["met"]]
            if missing:
                reward.reasons.append(f"the agent never said {missing}")
        elif component == "NL_ASSERTION" and judge is not None and episode.ended_normally:
            checks = judge_assertions(judge, criteria.get("nl_assertions") or [], episode.messages,
                                      judge_sampling or {})
            reward.components["NL_ASSERTION"] = float(all(c["met"] for c in checks))
            reward.checks["nl_assertions"] = checks
            if not reward.components["NL_ASSERTION"]:
                reward.reasons.append("the judge found unmet assertions")
        elif component == "NL_ASSERTION":
            reward.skipped[component] = "no judge model given" if judge is None else "the conversation ended early"
        else:
            reward.skipped[component] = "not implemented"
    for value in reward.components.values():
        reward.value *= value
    if not episode.ended_normally:
        reward.value = 0.0
        reward.reasons.insert(0, f"the conversation ended early ({episode.termination}: {episode.error})")
    return reward
