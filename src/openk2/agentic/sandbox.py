"""Run untrusted Python (and its unit tests) in kernel-isolated sandboxes; the code reward of RL and synthesis.

The report (section 3.2.1, "Coding & Software Engineering") scores code by the pass rate of unit tests run in
real execution sandboxes. `run_python(code, tests)` is that primitive for one machine. The walls are the
kernel's, not Python's (docs/sandbox.md has the threat model and the hostile-code table):

  bubblewrap   pid, network, ipc, uts and cgroup namespaces; a minimal read-only root (shared libraries, the
               interpreter and its libraries, nothing else of the host); a private /dev (null, zero,
               urandom, tty); a size-limited tmpfs /tmp holding the work directory (the disk quota);
               uid 65534 with no capabilities; no_new_privs                                 (sandbox_jail.py)
  seccomp      namespaces, mounts, ptrace and kernel attack surface always denied; process creation denied
               when max_processes=0                                                      (sandbox_seccomp.py)
  cgroups      memory.max over every process of the run (tmpfs included), pids.max, cpu.max; v2, else v1
                                                                                          (sandbox_cgroup.py)
  watchdog     a process of its own keeps the wall clock, kills the run when the caller dies (even by
               SIGKILL), and removes its cgroups                                        (sandbox_watchdog.py)
  rlimits,     inside the candidate, as defence in depth: CPU seconds, address space, file size, open
  audit hook   files; sockets, exec, process creation, writes outside the work directory ... (sandbox_child.py)

With `tests`, the tests run in a second sandbox (the judge, sandbox_judge.py) that reaches the code only
through calls whose arguments and results cross as plain data (sandbox_wire.py): the reward is computed
where the code cannot write, from built-in values compared with the judge's own `==`.

Where a layer cannot be had, `run_python` raises `SandboxUnavailableError` naming it; `insecure=True` runs
without the kernel layers (watchdog, rlimits and audit hook only) and is for trusted code only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from openk2.agentic.sandbox_child import SOLUTION_FILE as SOLUTION_FILE  # re-exported: part of this API
from openk2.agentic.sandbox_child import TESTS_FILE as TESTS_FILE
from openk2.agentic.sandbox_jail import SandboxUnavailableError as SandboxUnavailableError
from openk2.agentic.sandbox_jail import probe
from openk2.agentic.sandbox_result import CaseResult as CaseResult
from openk2.agentic.sandbox_result import SandboxLimits, SandboxResult
from openk2.agentic.sandbox_run import SandboxRun

if TYPE_CHECKING:
    from concurrent.futures import Future


def run_python(code: str, tests: str | None = None, timeout_s: float = 10.0, memory_mb: int = 512, *,
               cpu_time_s: float | None = None, max_file_mb: int = 16, max_open_files: int = 64,
               max_processes: int = 0, max_output_bytes: int = 64 << 10, max_disk_mb: int = 64, cpus: float = 1.0,
               stdin: str = "", setup: str | None = None, entry_points: list[str] | None = None,
               insecure: bool = False) -> SandboxResult:
    """Run `code`, then (in a separate judge sandbox) the `test*` functions / unittest cases of `tests`.

    timeout_s: wall clock including start-up; cpu_time_s: CPU seconds (default timeout_s); memory_mb: the
    memory cgroup limit over all the code's processes and files (and each process's address space);
    max_file_mb: largest file; max_disk_mb: the private /tmp; cpus: CPU bandwidth in cores; max_processes:
    child processes the code may create (0: none); max_output_bytes: kept per stream; stdin: what the code
    reads. The judge runs trusted `setup` code (e.g. HumanEval's prompt) before the tests and then binds
    `entry_points` (names in the code) as handles; without entry_points every top-level name of the code is
    bound. insecure=True drops the kernel layers: trusted code only. Raises SandboxUnavailableError when a
    layer is missing.
    """
    if not isinstance(code, str) or (tests is not None and not isinstance(tests, str)):
        raise ValueError("code and tests must be strings")
    if setup is not None and not isinstance(setup, str):
        raise ValueError("setup must be a string")
    if entry_points is not None and not all(isinstance(n, str) and n.isidentifier() for n in entry_points):
        raise ValueError("entry_points must be a list of Python identifiers")
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, cpu_time_s=cpu_time_s,
                           max_file_mb=max_file_mb, max_open_files=max_open_files, max_processes=max_processes,
                           max_output_bytes=max_output_bytes, max_disk_mb=max_disk_mb, cpus=cpus)
    run = SandboxRun(code, tests, stdin, limits, setup=setup, entry_points=entry_points, insecure=insecure)
    return run.run()


def check_sandbox() -> list[str]:
    """The kernel layers this machine gives every run; SandboxUnavailableError names a missing one."""
    return list(probe().layers)


class SandboxPool:
    """Share one machine's sandboxes among many callers (RL rollouts) with at most `max_concurrency` at once."""

    def __init__(self, max_concurrency: int | None = None) -> None:
        self.max_concurrency = max_concurrency or os.cpu_count() or 1
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        from concurrent.futures import ThreadPoolExecutor

        self._executor = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="openk2-sandbox")

    def submit(self, code: str, tests: str | None = None, **kwargs: Any) -> Future[SandboxResult]:
        """Queue one run; keyword arguments are those of `run_python`."""
        return self._executor.submit(run_python, code, tests, **kwargs)

    def map(self, jobs: Iterable[dict[str, Any]]) -> list[SandboxResult]:
        """Run many jobs (each a dict of `run_python` arguments) and return results in job order."""
        futures = [self.submit(**job) for job in jobs]
        return [f.result() for f in futures]

    async def run(self, code: str, tests: str | None = None, **kwargs: Any) -> SandboxResult:
        """The asyncio form of `submit`: awaits one run without blocking the event loop."""
        import asyncio

        return await asyncio.wrap_future(self.submit(code, tests, **kwargs))

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
