"""Run untrusted Python (and its unit tests) in a limited child process; the code reward of RL and synthesis.

The report (section 3.2.1, "Coding & Software Engineering") scores code by the pass rate of unit tests run in
real execution sandboxes. `run_python(code, tests)` is that primitive for one machine: a fresh `python -I -B`
child in its own session, a private temporary directory as cwd/HOME/TMPDIR (deleted afterwards), an empty
environment, and stacked layers, outermost first (docs/sandbox.md has the threat model):

  1. namespaces     `unshare`: network (only a downed loopback), pid (host processes invisible, all die with
                    the run), uts, ipc, and mount: every mount read-only except the sandbox directory, and the
                    caller's home directory hidden except the interpreter's files in it
  2. capabilities   `setpriv` empties the bounding and inheritable sets and sets no_new_privs
  3. pids cgroup    a per-run `pids.max` where /sys/fs/cgroup/pids is writable (RLIMIT_NPROC spares root)
  4. rlimits        CPU seconds, address space, file size, open files, (non-root) processes; no core files
  5. audit hook     in the child (sandbox_child.py): denies sockets, process creation, ctypes, writes outside
                    the directory, signals to other processes; a violation ends the run at once with its reason
  6. wall clock     the parent kills the child's process group (and its cgroup) on timeout

Layers 1-3 are used where the kernel and tools allow (probed once per process); `SandboxResult.isolation`
lists what a run actually had.
This module is the parent side: it validates limits, builds the isolation wrapper, launches and supervises the
child and folds its report into a `SandboxResult`. The child's runner (layers 4-5 and the tests) is
`sandbox_child.py`, started as a script by its file path (the directory stays visible inside the mounts).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from openk2.agentic import sandbox_child
from openk2.agentic.sandbox_child import SOLUTION_FILE as SOLUTION_FILE  # re-exported: part of this API
from openk2.agentic.sandbox_child import TESTS_FILE as TESTS_FILE

if TYPE_CHECKING:
    from concurrent.futures import Future

PIDS_CGROUP_ROOT = "/sys/fs/cgroup/pids"
_CHILD_SCRIPT = os.path.abspath(sandbox_child.__file__)  # run by path, not -m: the child imports nothing of openk2
_REPORT_CAP_BYTES = 8 << 20  # the child's structured report; far above any honest run


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
    isolation: list[str] = field(default_factory=list)  # layers this run had, e.g. ["netns", "audit-hook"]

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

    def __post_init__(self) -> None:
        checks = [(self.timeout_s > 0, "timeout_s must be > 0"),
                  (self.memory_mb >= 64, "memory_mb must be >= 64 (the interpreter alone needs ~30 MB)"),
                  (self.cpu_time_s is None or self.cpu_time_s > 0, "cpu_time_s must be > 0"),
                  (self.max_file_mb >= 1, "max_file_mb must be >= 1"),
                  (self.max_open_files >= 16, "max_open_files must be >= 16"),
                  (self.max_processes >= 0, "max_processes must be >= 0"),
                  (self.max_output_bytes >= 0, "max_output_bytes must be >= 0")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def cpu_seconds(self) -> int:
        """RLIMIT_CPU takes whole seconds; default to the wall limit."""
        return max(1, int(-(-(self.cpu_time_s or self.timeout_s) // 1)))


def run_python(code: str, tests: str | None = None, timeout_s: float = 10.0, memory_mb: int = 512, *,
               cpu_time_s: float | None = None, max_file_mb: int = 16, max_open_files: int = 64,
               max_processes: int = 0, max_output_bytes: int = 64 << 10, stdin: str = "") -> SandboxResult:
    """Run `code` (then its `test_*` functions / unittest cases from `tests`) in a fresh limited child process.

    timeout_s: wall clock including interpreter start-up; cpu_time_s: CPU seconds (default timeout_s);
    memory_mb: address-space limit; max_file_mb: largest file the code may write; max_processes: child
    processes the code may create (0: none; each can run any binary, so only raise it inside a container);
    max_output_bytes: kept per stream (stdout, stderr), the rest is dropped; stdin: text the code reads.
    """
    if not isinstance(code, str) or (tests is not None and not isinstance(tests, str)):
        raise ValueError("code and tests must be strings")
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, cpu_time_s=cpu_time_s,
                           max_file_mb=max_file_mb, max_open_files=max_open_files, max_processes=max_processes,
                           max_output_bytes=max_output_bytes)
    return _SandboxRun(code, tests, stdin, limits).run()


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


# ----------------------------------------------------------------------------------------------- parent side


class _CappedReader(threading.Thread):
    """Drain a pipe so the child never blocks on it, keeping the first `cap` bytes."""

    def __init__(self, stream: Any, cap: int) -> None:
        super().__init__(daemon=True)
        self.stream, self.cap, self.chunks, self.size, self.truncated = stream, cap, [], 0, False

    def run(self) -> None:
        with self.stream:
            while chunk := self.stream.read1(65536):
                keep = chunk[: max(0, self.cap - self.size)]
                self.chunks.append(keep)
                self.size += len(keep)
                self.truncated |= len(keep) < len(chunk)

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


class _PidsCgroup:
    """A per-run cgroup in the v1 pids hierarchy: caps the task count (root included) and finds every straggler."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def create(cls, name: str, max_pids: int) -> _PidsCgroup | None:
        """None where cgroups are not writable (unprivileged, read-only mount): the rlimit layer remains."""
        path = os.path.join(PIDS_CGROUP_ROOT, "openk2-sandbox", name)
        try:
            os.makedirs(path)
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(max_pids))
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
            return None
        return cls(path)

    def add(self, pid: int) -> None:
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def pids(self) -> list[int]:
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                return [int(line) for line in f if line.strip()]
        except OSError:
            return []

    def kill_all_and_remove(self) -> None:
        deadline = time.monotonic() + 5.0
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                _kill(pid)
            time.sleep(0.01)
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def _feed(pipe: Any, data: bytes) -> None:
    try:
        with pipe:
            pipe.write(data)
    except (BrokenPipeError, ValueError):  # the child died first; its exit status tells the story
        pass


def _kill(pid: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# Runs as root of the fresh namespaces, before capabilities are dropped: join the run's pids cgroup; cover the
# caller's home directory with an empty tmpfs, putting back only the interpreter's directories inside it (its
# keys and tokens are readable to uid 0 even without capabilities); then make every mount read-only except a
# bind mount of the sandbox directory and a private /dev/shm. util-linux 2.38 cannot remount read-only
# recursively, hence one remount per mount point.
_SETUP_SCRIPT = r"""
root="$1"; cgroup="$2"; home="$3"; keep="$4"; shift 4
if [ "$cgroup" != - ]; then echo $$ > "$cgroup/cgroup.procs" || exit 97; fi
mount --make-rprivate / && mount --bind "$root" "$root" || exit 97
mount -t tmpfs -o size=16m,nosuid,nodev tmpfs /dev/shm 2>/dev/null  # private: POSIX semaphores need it
if [ "$home" != - ]; then
    IFS='
'
    i=0; for k in $keep; do
        i=$((i + 1)); mkdir "$root/.keep$i" && mount --bind "$k" "$root/.keep$i" || exit 97
    done
    mount -t tmpfs -o size=1m,mode=755 tmpfs "$home" || exit 97
    i=0; for k in $keep; do
        i=$((i + 1)); mkdir -p "$k" && mount --move "$root/.keep$i" "$k" && rmdir "$root/.keep$i" || exit 97
    done
    unset IFS
fi
umount -l /sys/fs/cgroup 2>/dev/null  # a dozen mounts the code has no use for: fewer remounts below
for m in $(awk '{print $5}' /proc/self/mountinfo); do
    [ "$m" = "$root" ] || [ "$m" = /dev/shm ] || mount -o remount,bind,ro "$m" 2>/dev/null
done
cd "$root" || exit 97  # the inherited cwd still points into the now read-only mount below the bind
exec "$@"
"""
# PID 1 of a pid namespace only gets signals it handles, so SIGXCPU/SIGXFSZ would not kill Python there: a
# shell is PID 1 and reports a signal death as exit status 128 + signal.
_INIT = ["-c", '"$@"; exit $?', "sh"]
_CHILD_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
_DROP_CAPS = ["--bounding-set", "-all", "--inh-caps", "-all", "--no-new-privs", "--"]


@dataclass(frozen=True)
class _Isolation:
    """One way to wrap the child in kernel isolation; `command` fills in the per-run directory and cgroup."""

    name: str
    layers: tuple[str, ...]
    joins_cgroup: bool  # the wrapper puts itself into the cgroup (else the parent adds the child's pid)

    def command(self, root: str, cgroup: str | None) -> list[str]:
        python = [sys.executable, "-I", "-B", _CHILD_SCRIPT]
        unshare, setpriv = shutil.which("unshare") or "unshare", shutil.which("setpriv") or "setpriv"
        sh = shutil.which("sh") or "/bin/sh"
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        if self.name == "namespaces":
            return [unshare, *user, "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--uts", "--ipc",
                    "--", sh, "-c", _SETUP_SCRIPT, "sh", root, cgroup or "-", *_home_to_hide(root),
                    setpriv, *_DROP_CAPS, sh, *_INIT, *python]
        if self.name == "netns":
            return [unshare, *user, "--net", "--", setpriv, *_DROP_CAPS, *python]
        return python


def _home_to_hide(root: str) -> tuple[str, str]:
    """The caller's home directory and, newline-separated, the directories in it the child needs; "-" for none."""
    home = os.path.realpath(os.path.expanduser("~"))
    if home == "/" or not os.path.isdir(home) or _is_within(root, home) or "\n" in home:
        return "-", ""
    needed = {os.path.realpath(d) for d in (sys.base_prefix, sys.prefix, os.path.dirname(_CHILD_SCRIPT))}
    inside = sorted(d for d in needed if _is_within(d, home) and d != home)
    if any(d == home for d in needed):
        return "-", ""  # the interpreter is the home directory itself: nothing to hide around it
    keep = [d for d in inside if not any(_is_within(d, other) and d != other for other in inside)]
    return home, "\n".join(keep)


def _is_within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


_NAMESPACE_LAYERS = ("netns", "pidns", "utsns", "read-only-mounts", "home-hidden", "no-capabilities")
_ISOLATIONS = (_Isolation("namespaces", _NAMESPACE_LAYERS, True),
               _Isolation("netns", ("netns", "no-capabilities"), False),
               _Isolation("none", (), False))
_PROBE_WRITE_OUTSIDE = "try:\n    open({path!r}, 'w')\nexcept OSError:\n    raise SystemExit(0)\nraise SystemExit(3)"
_CHOSEN: _Isolation | None = None  # probed once per process: kernels and containers differ in what they allow
_CHOSEN_LOCK = threading.Lock()


def _isolation() -> _Isolation:
    """The strongest wrapper that starts a Python child here (and, for namespaces, really blocks outside writes)."""
    global _CHOSEN
    with _CHOSEN_LOCK:
        if _CHOSEN is not None:
            return _CHOSEN
        with tempfile.TemporaryDirectory(prefix="openk2-sandbox-probe-") as root, \
                tempfile.TemporaryDirectory(prefix="openk2-sandbox-probe-outside-") as outside:
            for candidate in _ISOLATIONS:
                check = "pass"
                if "read-only-mounts" in candidate.layers:
                    check = _PROBE_WRITE_OUTSIDE.format(path=os.path.join(outside, "x"))
                command = candidate.command(root, None)[:-1] + ["-c", check]  # python -I -B -c CHECK
                try:
                    probe = subprocess.run(command, capture_output=True, cwd=root, env={"PATH": _CHILD_PATH},
                                           timeout=60)
                except subprocess.TimeoutExpired:
                    continue
                if probe.returncode == 0:
                    _CHOSEN = candidate
                    break
            else:
                _CHOSEN = _ISOLATIONS[-1]  # even a bare child failed: runs will say why in their stderr
    return _CHOSEN


class _SandboxRun:
    """One run: set up the directory and cgroup, start the child, enforce the wall clock, read its report."""

    def __init__(self, code: str, tests: str | None, stdin: str, limits: SandboxLimits) -> None:
        self.code, self.tests, self.stdin, self.limits = code, tests, stdin, limits
        self.nonce = secrets.token_hex(16)  # report lines without it are ignored (the code shares fd space)

    def run(self) -> SandboxResult:
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="openk2-sandbox-") as root:
            root = os.path.realpath(root)
            max_tasks = self.limits.max_processes + 1 + 32  # the child, its children, and threads (pids counts them)
            cgroup = _PidsCgroup.create(os.path.basename(root), max_tasks)
            try:
                result = self._run_child(root, cgroup, start)
            finally:
                if cgroup is not None:
                    cgroup.kill_all_and_remove()
        result.duration_s = round(time.monotonic() - start, 4)
        return result

    def _run_child(self, root: str, cgroup: _PidsCgroup | None, start: float) -> SandboxResult:
        isolation = _isolation()
        command, layers = isolation.command(root, cgroup and cgroup.path), list(isolation.layers)
        if "home-hidden" in layers and _home_to_hide(root)[0] == "-":
            layers.remove("home-hidden")
        report_r, report_w = os.pipe()
        env = {"PATH": _CHILD_PATH, "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8"}
        try:
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    cwd=root, env=env, pass_fds=(report_w,), start_new_session=True)
        finally:
            os.close(report_w)
        if cgroup is not None:
            if not isolation.joins_cgroup:
                cgroup.add(proc.pid)  # before the config goes in: the child runs none of the code before that
            layers.append("pids-cgroup")
        cap = self.limits.max_output_bytes
        readers = [_CappedReader(proc.stdout, cap), _CappedReader(proc.stderr, cap),
                   _CappedReader(os.fdopen(report_r, "rb"), _REPORT_CAP_BYTES)]
        for reader in readers:
            reader.start()
        config = {"root": root, "code": self.code, "tests": self.tests, "stdin": self.stdin, "nonce": self.nonce,
                  "report_fd": report_w, "limits": asdict(self.limits), "cpu_seconds": self.limits.cpu_seconds}
        # fed from a thread: a child that never reads must not hold the caller past the wall clock
        threading.Thread(target=_feed, args=(proc.stdin, json.dumps(config).encode()), daemon=True).start()
        timed_out = False
        try:
            proc.wait(timeout=max(0.0, self.limits.timeout_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill(proc.pid, group=True)  # stragglers in its session, timed out or not
        if cgroup is not None:
            cgroup.kill_all_and_remove()
        proc.wait()
        for reader in readers:
            reader.join(timeout=2.0)
        result = self._assemble(readers[2].text(), proc.returncode, timed_out)
        result.stdout, result.stderr = readers[0].text(), readers[1].text()
        result.output_truncated = readers[0].truncated or readers[1].truncated
        result.isolation = layers + result.isolation
        return result

    def _assemble(self, report_text: str, returncode: int, timed_out: bool) -> SandboxResult:
        """Fold the child's report lines and its exit status into a result."""
        events = []
        for line in report_text.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.pop("nonce", None) == self.nonce:
                events.append(event)
        result = SandboxResult(exit_code=returncode)
        outcomes: dict[str, CaseResult] = {}
        done, killed = False, None
        for event in events:
            kind = event.get("event")
            if kind == "layers":
                result.isolation = list(event["layers"])
            elif kind == "collected":
                outcomes = {name: CaseResult(name, "not_run") for name in event["names"]}
            elif kind == "test":
                outcomes[event["name"]] = CaseResult(event["name"], event["status"], event.get("error"),
                                                      event.get("duration_s", 0.0))
            elif kind == "error":
                result.error = event["error"]
            elif kind == "killed" and killed is None:
                killed = event["reason"]
            elif kind == "done":
                done = True
        result.killed_reason = self._killed_reason(killed, returncode, timed_out, done)
        result.tests = list(outcomes.values())
        result.passed = sum(t.status == "passed" for t in result.tests)
        result.failed = sum(t.status in ("failed", "error", "not_run") for t in result.tests)
        return result

    def _killed_reason(self, killed: str | None, returncode: int, timed_out: bool, done: bool) -> str | None:
        limits = self.limits
        if timed_out:
            return f"wall-time limit {limits.timeout_s:g} s exceeded"
        if killed is not None:
            return killed
        if done and returncode == 0:
            return None
        # a signal death shows as -N directly, or as 128 + N through the pid namespace's shell init
        signum = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 160 else None
        if signum in (signal.SIGXCPU, signal.SIGKILL):  # SIGKILL: the hard CPU limit, one second after SIGXCPU
            return f"CPU-time limit {limits.cpu_seconds} s exceeded"
        if signum == signal.SIGXFSZ:
            return f"file-size limit {limits.max_file_mb} MB exceeded"
        if signum is not None:
            return f"killed by signal {signal.Signals(signum).name}"
        return None if done else f"exited with code {returncode} before finishing"
