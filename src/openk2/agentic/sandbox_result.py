"""The sandbox's data: the limits of a run (`SandboxLimits`) and what it did (`SandboxResult`, `CaseResult`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CaseResult:
    """One unit test: status is passed, failed (assertion), error (other exception), skipped or not_run."""

    name: str
    status: str
    error: str | None = None
    duration_s: float = 0.0


@dataclass
class SandboxResult:
    """What one sandboxed run did; `killed_reason` is None when it ran to completion."""

    passed: int = 0
    failed: int = 0
    killed_reason: str | None = None
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    duration_s: float = 0.0
    error: str | None = None  # the code itself raised while loading (SyntaxError, NameError, ...)
    tests: list[CaseResult] = field(default_factory=list)
    output_truncated: bool = False
    isolation: list[str] = field(default_factory=list)  # layers this run had, e.g. ["seccomp", "audit-hook"]
    memory_peak_mb: float | None = None  # the candidate's cgroup: processes, page cache and tmpfs together

    @property
    def total(self) -> int:
        return self.passed + self.failed

    @property
    def pass_rate(self) -> float:
        """Passed over passed+failed; 0.0 when no test ran (a reward must not be free for an empty test set)."""
        return self.passed / self.total if self.total else 0.0

    @property
    def ok(self) -> bool:
        """Ran to completion, loaded without error and failed no test."""
        return self.killed_reason is None and self.error is None and self.failed == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SandboxResult:
        data = dict(data)
        data["tests"] = [CaseResult(**t) for t in data.get("tests", [])]
        return cls(**data)


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one run, validated; see `run_python` for the meaning of each."""

    timeout_s: float = 10.0
    memory_mb: int = 512
    cpu_time_s: float | None = None
    max_file_mb: int = 16
    max_open_files: int = 64
    max_processes: int = 0
    max_output_bytes: int = 64 << 10
    max_disk_mb: int = 64  # the size of the private /tmp tmpfs (work directory included)
    cpus: float = 1.0  # CPU bandwidth of the run's cgroup, in cores

    def __post_init__(self) -> None:
        checks = [(self.timeout_s > 0, "timeout_s must be > 0"),
                  (self.memory_mb >= 64, "memory_mb must be >= 64 (the interpreter alone needs ~30 MB)"),
                  (self.cpu_time_s is None or self.cpu_time_s > 0, "cpu_time_s must be > 0"),
                  (self.max_file_mb >= 1, "max_file_mb must be >= 1"),
                  (self.max_open_files >= 16, "max_open_files must be >= 16"),
                  (self.max_processes >= 0, "max_processes must be >= 0"),
                  (self.max_output_bytes >= 0, "max_output_bytes must be >= 0"),
                  (self.max_disk_mb >= 1, "max_disk_mb must be >= 1"),
                  (0.01 <= self.cpus <= 1024, "cpus must be between 0.01 and 1024")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def cpu_seconds(self) -> int:
        """RLIMIT_CPU takes whole seconds; default to the wall limit."""
        return max(1, int(-(-(self.cpu_time_s or self.timeout_s) // 1)))
