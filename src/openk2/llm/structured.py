"""Structured output through one path for every `ChatModel`: a JSON schema in, a validated value (or a reason) out.

`achat_json(model, messages, schema, validate)` sends `response_format={"type": "json_schema", ...}`: the
`local:` and `hf:` backends decode under an llguidance grammar (the reply is JSON of the schema by construction),
`openai:` passes it to the endpoint. The reply is then parsed (`extract_json`, for endpoints that ignore the
format and wrap JSON in prose or fences) and checked by the caller's `validate`, which may normalise it or raise
ValueError with a message the model is shown on the retry. At most `max_attempts` model calls; the result says
what was kept or why nothing was: `model_error`, `truncated` (the budget ended first), `no_json`, `invalid`.
A transport failure (`openk2.llm.transport`) is no reply at all: it is raised, never counted as an attempt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from openk2.llm.base import ChatModel, ChatResponse
from openk2.llm.transport import describe, is_transport_error

JSON_INSTRUCTION = "Reply with one JSON value only (no prose, no code fence)."
REASONS = ("model_error", "truncated", "no_json", "invalid")

_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)
_DECODER = json.JSONDecoder()

Validator = Callable[[Any], Any]  # returns the (possibly normalised) value or raises ValueError


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


def json_schema_format(schema: dict | None, name: str = "reply") -> dict:
    """The OpenAI `response_format` asking for JSON of `schema` (any JSON object when None)."""
    if schema is None:
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@dataclass
class StructuredReply:
    """What one structured request gave: `value` (None if it gave up), the `reason` of the last failure and its
    message `error`, the model calls made and every failure's reason in order."""

    value: Any = None
    reason: str | None = None
    error: str | None = None
    attempts: int = 0
    failures: list[str] = field(default_factory=list)
    text: str | None = None  # the last reply's content, as the model wrote it

    @property
    def ok(self) -> bool:
        return self.reason is None and self.attempts > 0


def _check(reply: ChatResponse, validate: Validator | None) -> tuple[Any, str | None, str]:
    """(value, None, "") for a usable reply, else (None, reason, problem shown to the model)."""
    text = reply.content or ""
    try:
        value = extract_json(text)
    except ValueError as err:
        if reply.finish_reason == "length":
            return None, "truncated", "the reply was cut off by the token limit; answer more briefly"
        return None, "no_json", str(err)
    try:
        return (validate(value) if validate is not None else value), None, ""
    except ValueError as err:
        return None, "invalid", f"the JSON does not match what was asked: {err}"


class _Loop:
    """The retry bookkeeping shared by the sync and async forms."""

    def __init__(self, messages: Sequence[dict], validate: Validator | None, schema: dict | None,
                 max_attempts: int, sampling: dict) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.convo, self.validate, self.max_attempts = list(messages), validate, max_attempts
        self.sampling = {**sampling, "response_format": json_schema_format(schema)}
        self.result = StructuredReply()

    def failed_call(self, err: Exception) -> None:
        if is_transport_error(err):
            raise err
        self._fail("model_error", describe(err))

    def _fail(self, reason: str, problem: str) -> None:
        self.result.failures.append(reason)
        self.result.reason, self.result.error = reason, problem

    def take(self, replies: list[ChatResponse]) -> bool:
        """True when done (a usable value); else the conversation is extended with the feedback."""
        reply = replies[0] if replies else ChatResponse(content=None)
        self.result.text = reply.content
        value, reason, problem = _check(reply, self.validate)
        if reason is None:
            self.result.value, self.result.reason, self.result.error = value, None, None
            return True
        self._fail(reason, problem)
        self.convo = [*self.convo, {"role": "assistant", "content": reply.content or ""},
                      {"role": "user", "content": f"That reply cannot be used: {problem}. {JSON_INSTRUCTION}"}]
        return False


async def achat_json(model: ChatModel, messages: Sequence[dict], schema: dict | None = None,
                     validate: Validator | None = None, *, max_attempts: int = 3, **sampling: Any) -> StructuredReply:
    """Ask `model` for JSON of `schema` (validated by `validate`), retrying at most `max_attempts` calls."""
    loop = _Loop(messages, validate, schema, max_attempts, sampling)
    for _ in range(max_attempts):
        loop.result.attempts += 1
        try:
            replies = await model.achat(loop.convo, **loop.sampling)
        except Exception as err:  # noqa: BLE001 - a flaky backend is one failed attempt, not a crashed run
            loop.failed_call(err)
            continue
        if loop.take(replies):
            break
    return loop.result


def chat_json(model: ChatModel, messages: Sequence[dict], schema: dict | None = None,
              validate: Validator | None = None, *, max_attempts: int = 3, **sampling: Any) -> StructuredReply:
    """`achat_json` for synchronous callers (same request, same bounded retries)."""
    loop = _Loop(messages, validate, schema, max_attempts, sampling)
    for _ in range(max_attempts):
        loop.result.attempts += 1
        try:
            replies = model.chat(loop.convo, **loop.sampling)
        except Exception as err:  # noqa: BLE001 - as in achat_json
            loop.failed_call(err)
            continue
        if loop.take(replies):
            break
    return loop.result
