"""Telling "the endpoint is down" from "the model answered badly", for every job that calls a model.

A remote backend retries a failed request itself, with exponential backoff (`OpenAIChatModel`: the official
client's `max_retries`, for refused or reset connections, timeouts, 408/409/429 and 5xx). That is the only retry
layer. What still fails after it is a transport failure: not a result about the request, so jobs that record
per-item outcomes (rephrase rejects, synthesis stores, evaluation scores) must not record it. They leave the item
pending and stop with `EndpointUnreachable`, one line saying how to resume.
"""

from __future__ import annotations

_RETRYABLE_STATUS = (408, 409, 429)  # plus every 5xx: the statuses the openai client itself retries


class EndpointUnreachable(RuntimeError):
    """A model endpoint failed after the backend's retries; the work that needed it was left pending."""


def is_transport_error(exc: BaseException) -> bool:
    """A failure to reach the model (refused/reset connection, timeout, 408/409/429, 5xx), not a reply about
    the request; `EndpointUnreachable` counts too, so a job's own stop passes through outer handlers."""
    if isinstance(exc, (ConnectionError, TimeoutError, EndpointUnreachable)):
        return True
    try:
        import openai
    except ImportError:
        return False
    if isinstance(exc, openai.APIConnectionError):  # includes APITimeoutError
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code in _RETRYABLE_STATUS or exc.status_code >= 500
    return False


def describe(exc: BaseException, limit: int = 200) -> str:
    """`Type: message` on one line, at most `limit` characters."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
