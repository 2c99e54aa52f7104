"""One sandboxed run, parent side: pipes, the watchdog, the two sandboxes, and the result read back from them.

With tests there are two sandboxes: the candidate (runs the code, answers calls) and the judge (runs the
tests, reports outcomes), joined only by two pipes; without tests, the candidate alone. A watchdog process
(`sandbox_watchdog.py`) starts them in their cgroups, enforces the wall clock and cleans up even when this
process dies. Test outcomes are read only from the judge's report pipe, which the candidate never holds.
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
from dataclasses import asdict
from typing import Any

from openk2.agentic.sandbox_jail import WORK_DIR, SandboxUnavailableError, probe
from openk2.agentic.sandbox_result import CaseResult, SandboxLimits, SandboxResult

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPORT_CAP_BYTES = 8 << 20  # a runner's structured report; far above any honest run
_JUDGE_MEMORY_MB = 512
_THREADS = 32  # tasks a run may have beyond its processes: the interpreter's threads (pids.max counts them)


class _CappedReader(threading.Thread):
    """Drain a pipe so the writer never blocks on it, keeping the first `cap` bytes."""

    def __init__(self, fd: int, cap: int) -> None:
        super().__init__(daemon=True)
        self.stream, self.cap, self.chunks, self.size, self.truncated = os.fdopen(fd, "rb"), cap, [], 0, False
        self.start()

    def run(self) -> None:
        with self.stream:
            while chunk := self.stream.read1(65536):
                keep = chunk[: max(0, self.cap - self.size)]
                self.chunks.append(keep)
                self.size += len(keep)
                self.truncated |= len(keep) < len(chunk)

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


def _feed(fd: int, data: bytes) -> None:
    try:
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(data)
    except (BrokenPipeError, ValueError, OSError):  # the reader died first; its exit status tells the story
        pass


class _Box:
    """One sandbox's pipes: its config in, stdout, stderr and report out, plus the fds it keeps."""

    def __init__(self, name: str, config: dict, limits: SandboxLimits, seccomp: bytes | None) -> None:
        self.name, self.config, self.limits = name, config, limits
        self.stdin_r, self.stdin_w = os.pipe()
        self.out_r, self.out_w = os.pipe()
        self.err_r, self.err_w = os.pipe()
        self.report_r, self.report_w = os.pipe()
        self.keep = [self.report_w]
        self.seccomp_fd = None
        if seccomp is not None:
            self.seccomp_fd, write = os.pipe()
            os.write(write, seccomp)  # a few hundred bytes: fits the pipe buffer
            os.close(write)
            self.keep.append(self.seccomp_fd)
        config["report_fd"] = self.report_w

    def child_side(self) -> list[int]:
        return [self.stdin_r, self.out_w, self.err_w, *self.keep]


class SandboxRun:
    """Set up, launch through the watchdog, wait, and fold the reports into a `SandboxResult`."""

    def __init__(self, code: str, tests: str | None, stdin: str, limits: SandboxLimits, *, setup: str | None,
                 entry_points: list[str] | None, insecure: bool) -> None:
        self.code, self.tests, self.stdin, self.limits = code, tests, stdin, limits
        self.setup, self.entry_points, self.insecure = setup, entry_points, insecure
        self.nonce = secrets.token_hex(16)

    def run(self) -> SandboxResult:
        start = time.monotonic()
        jail = None if self.insecure else probe()
        scratch: list[str] = []
        try:
            result = self._run(jail, scratch)
        finally:
            for d in scratch:
                shutil.rmtree(d, ignore_errors=True)
        result.duration_s = round(time.monotonic() - start, 4)
        return result

    def _config(self, role: str, jail: Any, scratch: list[str], limits: SandboxLimits) -> dict:
        root = WORK_DIR
        if jail is None:
            root = os.path.realpath(tempfile.mkdtemp(prefix=f"openk2-sandbox-{role}-"))
            scratch.append(root)
        return {"role": role, "root": root, "nonce": self.nonce, "limits": asdict(limits),
                "cpu_seconds": limits.cpu_seconds, "extra_paths": list(jail.site_paths) if jail else []}

    def _run(self, jail: Any, scratch: list[str]) -> SandboxResult:
        from openk2.agentic.sandbox_seccomp import seccomp_bpf

        limits = self.limits
        candidate_config = {**self._config("candidate", jail, scratch, limits), "code": self.code,
                            "stdin": self.stdin, "call_in": None, "call_out": None}
        boxes = [_Box("candidate", candidate_config, limits,
                      None if jail is None else seccomp_bpf(limits.max_processes == 0))]
        if self.tests is not None:
            judge_limits = SandboxLimits(timeout_s=limits.timeout_s, memory_mb=max(_JUDGE_MEMORY_MB, limits.memory_mb),
                                         max_file_mb=16, max_open_files=64, max_disk_mb=16)
            judge_config = {**self._config("judge", jail, scratch, judge_limits), "tests": self.tests,
                            "setup": self.setup, "entry_points": self.entry_points}
            judge = _Box("judge", judge_config, judge_limits, None if jail is None else seccomp_bpf(True))
            to_candidate_r, to_candidate_w = os.pipe()
            to_judge_r, to_judge_w = os.pipe()
            candidate_config.update(call_in=to_candidate_r, call_out=to_judge_w)
            judge_config.update(call_in=to_judge_r, call_out=to_candidate_w)
            boxes[0].keep += [to_candidate_r, to_judge_w]
            judge.keep += [to_judge_r, to_candidate_w]
            boxes.append(judge)
        lifeline_r, lifeline_w = os.pipe()
        status_r, status_w = os.pipe()
        watchdog_config = {"timeout_s": limits.timeout_s, "lifeline_fd": lifeline_r, "status_fd": status_w,
                           "primary": boxes[-1].name, "sandboxes": [self._spec(box, jail) for box in boxes]}
        child_fds = [fd for box in boxes for fd in box.child_side()]
        config_r, config_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            watchdog = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", os.path.join(_HERE, "sandbox_watchdog.py")],
                stdin=config_r, stdout=subprocess.DEVNULL, stderr=err_w,
                pass_fds=(*child_fds, lifeline_r, status_w), start_new_session=True)
        finally:
            for fd in (*child_fds, lifeline_r, status_w, config_r, err_w):
                os.close(fd)
        watchdog_err = _CappedReader(err_r, 64 << 10)
        cap = limits.max_output_bytes
        readers = {box.name: (_CappedReader(box.out_r, cap), _CappedReader(box.err_r, cap),
                              _CappedReader(box.report_r, _REPORT_CAP_BYTES)) for box in boxes}
        status_reader = _CappedReader(status_r, 1 << 20)
        for box in boxes:  # fed from threads: a sandbox that never reads must not hold this past the wall clock
            threading.Thread(target=_feed, args=(box.stdin_w, json.dumps(box.config).encode()), daemon=True).start()
        _feed(config_w, json.dumps(watchdog_config).encode())
        status_reader.join(timeout=limits.timeout_s + 30)  # EOF when the watchdog exits; it keeps the clock
        if status_reader.is_alive():  # the backstop: bubblewrap's --die-with-parent takes the sandboxes along
            os.killpg(watchdog.pid, signal.SIGKILL)
        watchdog.wait()
        os.close(lifeline_w)
        for reader in (*[r for trio in readers.values() for r in trio], status_reader, watchdog_err):
            reader.join(timeout=5.0)
        try:
            status = json.loads(status_reader.text())
        except ValueError:
            raise SandboxUnavailableError("the sandbox watchdog died without a status: "
                                          + (watchdog_err.text().strip()[-500:] or f"exit {watchdog.returncode}")
                                          ) from None
        if status.get("error"):
            raise SandboxUnavailableError(status["error"])
        return self._assemble(readers, status, jail)

    def _spec(self, box: _Box, jail: Any) -> dict:
        """The watchdog's view of one sandbox: its command line, streams, kept fds and cgroup limits."""
        limits = box.limits
        if jail is None:
            argv = [sys.executable, "-I", "-B", os.path.join(_HERE, "sandbox_child.py")]
            cgroup = None
        else:
            argv = jail.command(box.seccomp_fd, limits.max_disk_mb, limits.max_processes > 0)
            cgroup = {"layout": jail.cgroup_layout, "memory_bytes": limits.memory_mb << 20,
                      "max_tasks": limits.max_processes + 3 + _THREADS, "cpus": limits.cpus}
        return {"name": box.name, "argv": argv, "stdin": box.stdin_r, "stdout": box.out_w, "stderr": box.err_w,
                "pass_fds": box.keep, "cgroup": cgroup}

    def _events(self, text: str) -> list[dict]:
        events = []
        for line in text.splitlines():
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):  # the candidate can write to its report channel: any bytes
                continue
            if isinstance(event, dict) and event.pop("nonce", None) == self.nonce:
                events.append(event)
        return events

    def _assemble(self, readers: dict, status: dict, jail: Any) -> SandboxResult:
        """Fold the runners' reports and the watchdog's status into a result."""
        out, err, report = readers["candidate"]
        candidate = self._events(report.text())
        box = status["sandboxes"].get("candidate", {})
        result = SandboxResult(exit_code=box.get("returncode"), stdout=out.text(), stderr=err.text(),
                               output_truncated=out.truncated or err.truncated)
        result.isolation = list(jail.layers if jail else ("watchdog",))
        if self.tests is not None:
            result.isolation.append("judge-process")
        violation = None
        for event in candidate:
            kind = event.get("event")
            if kind == "layers" and isinstance(event.get("layers"), list):
                result.isolation += [str(x) for x in event["layers"]]
            elif kind == "error" and result.error is None:
                result.error = str(event.get("error"))
            elif kind == "killed" and violation is None:
                violation = str(event.get("reason"))
        candidate_done = any(e.get("event") == "done" for e in candidate)
        judge_done = True
        if self.tests is not None:
            judge_done = self._read_judge(result, self._events(readers["judge"][2].text()))
        peak = box.get("memory_peak")
        result.memory_peak_mb = round(peak / (1 << 20), 1) if isinstance(peak, int) else None
        result.killed_reason = self._killed_reason(status, violation, candidate_done, judge_done,
                                                   readers.get("judge", (None, None, None))[1])
        return result

    def _read_judge(self, result: SandboxResult, events: list[dict]) -> bool:
        outcomes: dict[str, CaseResult] = {}
        done = False
        for event in events:
            kind = event.get("event")
            if kind == "collected":
                outcomes = {name: CaseResult(name, "not_run") for name in event["names"]}
            elif kind == "test":
                outcomes[event["name"]] = CaseResult(event["name"], event["status"], event.get("error"),
                                                      event.get("duration_s", 0.0))
            elif kind == "error":
                result.error = (result.error + "\n" if result.error else "") + str(event["error"])
            elif kind == "done":
                done = True
        result.tests = list(outcomes.values())
        result.passed = sum(t.status == "passed" for t in result.tests)
        result.failed = sum(t.status in ("failed", "error", "not_run") for t in result.tests)
        return done

    def _killed_reason(self, status: dict, violation: str | None, candidate_done: bool, judge_done: bool,
                       judge_err: Any) -> str | None:
        limits = self.limits
        box = status["sandboxes"].get("candidate", {})
        if status.get("timed_out"):
            return f"wall-time limit {limits.timeout_s:g} s exceeded"
        if violation is not None:
            return violation
        if box.get("oom_kills"):
            return f"memory limit {limits.memory_mb} MB exceeded (the kernel killed a process of the run)"
        signum = _signal_of(box.get("returncode"))
        if signum is not None and not box.get("killed_by_watchdog"):
            if signum in (signal.SIGXCPU, signal.SIGKILL):  # SIGKILL: the hard CPU limit, one second after SIGXCPU
                return f"CPU-time limit {limits.cpu_seconds} s exceeded"
            if signum == signal.SIGXFSZ:
                return f"file-size limit {limits.max_file_mb} MB exceeded"
            return f"killed by signal {signal.Signals(signum).name}"
        if not judge_done:
            judge = status["sandboxes"].get("judge", {})
            why = "out of memory" if judge.get("oom_kills") else f"exit code {judge.get('returncode')}"
            last = (judge_err.text().strip().splitlines() or [""])[-1][:300] if judge_err else ""
            return f"the judge failed ({why}){': ' + last if last else ''}"
        if not candidate_done and not box.get("killed_by_watchdog"):
            code = box.get("returncode")
            if self.tests is not None:
                return f"the code ended its own process (exit code {code}) before the tests finished"
            return f"exited with code {code} before finishing"
        return None


def _signal_of(returncode: int | None) -> int | None:
    """The signal that ended a process: -N from Popen, or 128 + N passed on by bwrap."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    return returncode - 128 if 128 < returncode < 160 else None


