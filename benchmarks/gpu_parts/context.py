"""What a part receives (device, size mode, its deadline) and the exceptions that end a part early."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


class PartSkipped(Exception):
    """The part cannot run here (a missing package, no CUDA); the message is the one-line reason."""


class PartTimeout(BaseException):
    """Raised by the worker's alarm when a part overruns its limit (BaseException: `except Exception` in a part
    must not swallow it)."""


@dataclass
class PartContext:
    """A part's inputs: where to run, how big, until when (time.monotonic), and where the repository is."""

    device: torch.device
    quick: bool
    deadline: float
    repo: Path
    notes: list[str] = field(default_factory=list)

    def left(self) -> float:
        """Seconds until this part's deadline."""
        return self.deadline - time.monotonic()

    def progress(self, message: str) -> None:
        """One flushed progress line."""
        print(f"    {message}", flush=True)

    def sync(self) -> None:
        """Wait for queued device work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
