"""Wall time spent in communication, for the parallel trainer's `comm_share` metric.

A process-wide accumulator: code that waits on a collective wraps the call in `timed()` (or adds a measured
interval with `add`), and the trainer takes the sum once per step. Timed: gradient reduction to owners and
the AdamW reduce-scatter, the Muon update broadcasts and the AdamW all-gather (minus the update arithmetic
done while they are in flight), the gradient-norm and QK-Clip all-reduces, the EP all-to-alls of forward and
backward (issue and wait, not the work overlapped between them) and the trainer's loss/count all-reduces. Not
timed: the pipeline's send/recv (inside torch's schedule). A blocking collective's time includes waiting for
slower ranks, so on a shared CPU this is an upper bound of the wire time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

_total = 0.0


@contextmanager
def timed() -> Iterator[None]:
    """Add the block's wall time to the communication total."""
    start = time.perf_counter()
    try:
        yield
    finally:
        add(time.perf_counter() - start)


def add(seconds: float) -> None:
    """Add `seconds` of communication."""
    global _total
    _total += seconds


def take() -> float:
    """The communication seconds since the last `take()`, and reset."""
    global _total
    out, _total = _total, 0.0
    return out
