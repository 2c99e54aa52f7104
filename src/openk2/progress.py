"""Progress for long loops: a tqdm bar on a terminal, flushed plain lines in a log file or a pipe.

tqdm redraws its bar with carriage returns, which a log file keeps: `make demo > log` held one line of
several kilobytes per evaluation. Off a terminal, `progress_bar` prints `desc: done/total (postfix, seconds)` at
the start, at most every `every_s` seconds, and at the end, each line flushed, so a piped run is never silent.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm


class LineProgress:
    """The subset of tqdm's interface the loops use (`update`, `set_postfix`, `close`), as flushed lines."""

    def __init__(self, total: int, desc: str, unit: str, initial: int = 0, every_s: float = 30.0,
                 file: TextIO | None = None) -> None:
        self.total, self.desc, self.unit, self.n, self.every_s = total, desc, unit, initial, every_s
        self.file = file if file is not None else sys.stderr
        self.postfix = ""
        self.start = self.last = time.perf_counter()
        self.closed = False
        self._shown: tuple[int, str] | None = None  # what the last line said: close() does not repeat it
        self._print()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            self._print()

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._shown != (self.n, self.postfix):
                self._print()

    def _print(self) -> None:
        self._shown = (self.n, self.postfix)
        extra = f"{self.postfix}, " if self.postfix else ""
        seconds = time.perf_counter() - self.start
        print(f"{self.desc}: {self.n}/{self.total} {self.unit}s ({extra}{seconds:.0f} s)", file=self.file, flush=True)


def progress_bar(total: int, desc: str, unit: str, initial: int = 0, enabled: bool = True,
                 every_s: float = 30.0, **tqdm_kwargs: Any) -> tqdm | LineProgress:
    """A tqdm bar when stderr is a terminal, else a `LineProgress`; `enabled=False` gives a silent tqdm."""
    if not enabled:
        return tqdm(total=total, initial=initial, disable=True)
    if sys.stderr.isatty():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, **tqdm_kwargs)
    return LineProgress(total, desc, unit, initial=initial, every_s=every_s)
