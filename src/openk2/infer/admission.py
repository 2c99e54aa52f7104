"""Admission by work: how many tokens one request, and all requests together, may ask the engine to generate.

A chat request asks for up to `n x max_tokens` new tokens: its work. Without a bound, one client asking for
`n=128, max_tokens=2000` fills every engine slot for minutes and everyone else waits behind it. `WorkBudget`
holds two bounds:

- `per_request`: a request whose work is above it is refused outright (400: ask for less);
- `per_server`: the work admitted and not yet finished, summed over all requests; a request that would push the
  sum above it is refused for now (429: the server is busy, retry later), so the queue in front of the engine,
  and the wait of a new request, stay bounded.

Work is reserved when a request is handed to the engine and released when the engine is done with it (finished,
aborted because its client went away, or failed), so the sum counts exactly what the engine still owes.
"""

from __future__ import annotations

import threading

DEFAULT_MAX_REQUEST_WORK = 32_768  # n x max_tokens of one request: n=8 at the default max_tokens of 4096
DEFAULT_MAX_INFLIGHT_WORK = 262_144  # all requests in flight together: 8 such requests


class WorkBudget:
    """Thread-safe: reserved from the event loop, released from the engine thread. None disables a bound."""

    def __init__(self, per_request: int | None = DEFAULT_MAX_REQUEST_WORK,
                 per_server: int | None = DEFAULT_MAX_INFLIGHT_WORK) -> None:
        for name, value in (("per-request", per_request), ("per-server", per_server)):
            if value is not None and value < 1:
                raise ValueError(f"the {name} work limit (n x max_tokens) must be positive, got {value}")
        if per_request is not None and per_server is not None and per_request > per_server:
            raise ValueError(f"the per-request work limit ({per_request}) is above the per-server one "
                             f"({per_server}): such a request could never be admitted")
        self.per_request = per_request
        self.per_server = per_server
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        """Work admitted and not yet released."""
        with self._lock:
            return self._in_flight

    def too_big(self, work: int) -> bool:
        """Whether one request of this much work is over the per-request bound."""
        return self.per_request is not None and work > self.per_request

    def reserve(self, work: int) -> bool:
        """Admit `work` if the per-server bound allows it (True), else leave everything unchanged (False)."""
        with self._lock:
            if self.per_server is not None and self._in_flight + work > self.per_server:
                return False
            self._in_flight += work
            return True

    def release(self, work: int) -> None:
        """Give back what `reserve` admitted."""
        with self._lock:
            self._in_flight -= work
            assert self._in_flight >= 0, "released more work than was reserved"
