"""Structured JSON out of a chat model: ask, extract the first JSON value from the reply, validate, retry.

Models wrap JSON in code fences, put prose around it, or break it. `extract_json` finds the first
decodable object or array in a reply; `ask_json` sends the request, checks the value with a caller's
validator and, on failure, shows the model its reply and the error and asks again, a bounded number of times.
Every attempt and failure is counted in a `JSONStats`, so a run can report how often its models misbehave.
A transport failure (`openk2.llm.transport`: the endpoint is down after the backend's retries) is no reply at
all: it is raised, never counted as a bad attempt, so the caller's work item stays pending.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from openk2.llm.base import ChatModel
from openk2.llm.transport import is_transport_error

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
_DECODER = json.JSONDecoder()

JSON_INSTRUCTION = "Reply with one JSON value only (no prose, no code fence)."


def extract_json(text: str | None) -> Any:
    """The first JSON object or array in `text` (fenced blocks first, then anywhere); ValueError if none."""
    if not text:
        raise ValueError("the reply is empty")
    candidates = [m.group(1) for m in _FENCE.finditer(text)] + [text]
    for chunk in candidates:
        for start, ch in enumerate(chunk):
            if ch not in "{[":
                continue
            try:
                value, _ = _DECODER.raw_decode(chunk, start)
            except json.JSONDecodeError:
                continue
            return value
    raise ValueError("no JSON object or array found in the reply")


@dataclass
class JSONStats:
    """Counts over `ask_json` calls: requests, model calls, bad replies by reason, requests that gave up."""

    requests: int = 0
    attempts: int = 0
    succeeded: int = 0
    gave_up: int = 0
    failures: dict[str, int] = field(default_factory=dict)

    def count_failure(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "attempts": self.attempts, "succeeded": self.succeeded,
                "gave_up": self.gave_up, "failures": dict(sorted(self.failures.items()))}


Validator = Callable[[Any], Any]  # returns the (possibly normalised) value or raises ValueError


async def ask_json(model: ChatModel, messages: Sequence[dict], validate: Validator | None = None, *,
                   max_attempts: int = 3, stats: JSONStats | None = None, **sampling: Any) -> Any | None:
    """The validated JSON value of the model's reply to `messages`, or None after `max_attempts` bad replies.

    `validate(value)` returns the value to keep (it may normalise it) or raises ValueError with a message the
    model is shown on the retry. Model exceptions count as failed attempts too (reason "model_error"), except
    transport failures, which are raised.
    """
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    stats = stats if stats is not None else JSONStats()
    stats.requests += 1
    convo = list(messages)
    for _ in range(max_attempts):
        stats.attempts += 1
        try:
            reply = (await model.achat(convo, **sampling))[0].content or ""
        except Exception as err:  # noqa: BLE001 - a flaky backend is one failed attempt, not a crashed run
            if is_transport_error(err):
                raise
            stats.count_failure("model_error")
            continue
        try:
            value = extract_json(reply)
        except ValueError as err:
            stats.count_failure("no_json")
            problem = str(err)
        else:
            try:
                value = validate(value) if validate is not None else value
            except ValueError as err:
                stats.count_failure("invalid")
                problem = f"the JSON does not match what was asked: {err}"
            else:
                stats.succeeded += 1
                return value
        convo = [*convo, {"role": "assistant", "content": reply},
                 {"role": "user", "content": f"That reply cannot be used: {problem}. {JSON_INSTRUCTION}"}]
    stats.gave_up += 1
    return None
