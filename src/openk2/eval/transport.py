"""Telling "the endpoint is down" from "the model answered badly".

Benchmarks score any exception from a model call as the model's failure (a 0 with the error), which is right
for a reply the backend rejects but wrong for a refused connection or a timeout: those samples would be
recorded as 0 and never retried. `TransportGuard` wraps a remote `ChatModel`, passes every call through and
remembers, per thread, a transport failure, so the harness can leave such samples unrecorded (a rerun scores
them) and stop early when the endpoint is unreachable.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from openk2.llm.base import ChatModel, ChatResponse
from openk2.llm.transport import is_transport_error

__all__ = ["TransportGuard", "is_transport_error"]


class TransportGuard(ChatModel):
    """`inner` with its transport failures remembered per thread (`take_failure`); everything else unchanged."""

    def __init__(self, inner: ChatModel) -> None:
        self.inner = inner
        self.name = inner.name
        self._local = threading.local()

    def chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
             **sampling: Any) -> list[ChatResponse]:
        try:
            return self.inner.chat(messages, tools, **sampling)
        except Exception as exc:
            if is_transport_error(exc):
                self._local.failure = exc
            raise

    def take_failure(self) -> BaseException | None:
        """The transport failure seen by this thread since the last call, if any (and forget it)."""
        failure = getattr(self._local, "failure", None)
        self._local.failure = None
        return failure

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, attr: str) -> Any:  # backend-specific attributes (model id, client) stay reachable
        return getattr(self.inner, attr)
