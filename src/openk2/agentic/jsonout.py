"""Structured JSON for the synthesis roles: `openk2.llm.structured` plus counts per role.

Every generator, simulator and judge request goes through `ask_structured` (or `ask_json`, its value only):
the request carries a JSON schema, so the `local:` and `hf:` backends decode under the grammar and `openai:`
endpoints get `response_format`; the value is checked by a caller's validator and retried a bounded number of
times. `JSONStats` counts requests, model calls and failures by reason, so a run can report how often its
models misbehave. A transport failure (`openk2.llm.transport`) is raised, never counted, so the work item stays
pending.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from openk2.llm.base import ChatModel
from openk2.llm.structured import JSON_INSTRUCTION, StructuredReply, Validator, achat_json, extract_json

__all__ = ["JSON_INSTRUCTION", "JSONStats", "StructuredReply", "Validator", "ask_json", "ask_structured",
           "extract_json"]


@dataclass
class JSONStats:
    """Counts over structured requests: requests, model calls, bad replies by reason, requests that gave up."""

    requests: int = 0
    attempts: int = 0
    succeeded: int = 0
    gave_up: int = 0
    failures: dict[str, int] = field(default_factory=dict)

    def count_failure(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def add(self, reply: StructuredReply) -> None:
        """Count one finished request."""
        self.requests += 1
        self.attempts += reply.attempts
        for reason in reply.failures:
            self.count_failure(reason)
        if reply.ok:
            self.succeeded += 1
        else:
            self.gave_up += 1

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "attempts": self.attempts, "succeeded": self.succeeded,
                "gave_up": self.gave_up, "failures": dict(sorted(self.failures.items()))}


async def ask_structured(model: ChatModel, messages: Sequence[dict], validate: Validator | None = None, *,
                         schema: dict | None = None, max_attempts: int = 3, stats: JSONStats | None = None,
                         **sampling: Any) -> StructuredReply:
    """The structured reply to `messages` (value, or the reason it gave up), counted in `stats`."""
    reply = await achat_json(model, messages, schema, validate, max_attempts=max_attempts, **sampling)
    if stats is not None:
        stats.add(reply)
    return reply


async def ask_json(model: ChatModel, messages: Sequence[dict], validate: Validator | None = None, *,
                   schema: dict | None = None, max_attempts: int = 3, stats: JSONStats | None = None,
                   **sampling: Any) -> Any | None:
    """The validated JSON value of the model's reply to `messages`, or None after `max_attempts` bad replies."""
    reply = await ask_structured(model, messages, validate, schema=schema, max_attempts=max_attempts, stats=stats,
                                 **sampling)
    return reply.value if reply.ok else None
