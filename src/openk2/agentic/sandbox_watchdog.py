"""The sandbox's watchdog: a process of its own that starts the sandboxes, enforces the wall clock and cleans up.

`openk2.agentic.sandbox` starts `python -I -S -B sandbox_watchdog.py` per run (in a new session) and writes
one JSON config to its stdin: the sandboxes (bubblewrap command lines, their standard streams and the fds
each may keep), their cgroup limits, the wall clock, a lifeline fd and a status fd. The watchdog

1. creates each sandbox's cgroup (`sandbox_cgroup.py`) and starts each command inside it (the forked child
   joins the cgroup before it execs, so no code runs outside it); bubblewrap's `--die-with-parent` kills a
   sandbox if the watchdog itself dies;
2. waits until the primary sandbox (the judge, or the candidate when there are no tests) exits, the wall
   clock runs out, or the lifeline reports EOF (the caller died, even by SIGKILL: its end closes with it);
3. kills whatever is left, cgroup by cgroup (daemons that left the session included), reads OOM kills and
   peak memory, removes the cgroups, and writes one JSON status line to the status fd.

So the wall clock holds even if the caller hangs, and nothing of a run outlives its caller.
Standard library only (`-S`: not even site-packages), plus `sandbox_cgroup.py` beside this file.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

_GRACE_S = 0.5  # after the primary sandbox ends, how long the others get to exit by themselves


def main() -> None:
    config = json.loads(sys.stdin.buffer.read())
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sandbox_cgroup

    status: dict = {"sandboxes": {}, "timed_out": False, "caller_gone": False, "error": None}
    deadline = time.monotonic() + config["timeout_s"]
    procs: dict[str, subprocess.Popen] = {}
    groups: dict = {}
    try:
        for box in config["sandboxes"]:
            name, group = box["name"], None
            if box.get("cgroup"):
                spec = box["cgroup"]
                group = groups[name] = sandbox_cgroup.RunCgroup.create(
                    spec["layout"], spec["memory_bytes"], spec["max_tasks"], spec["cpus"], os.getpid())
            procs[name] = subprocess.Popen(
                box["argv"], stdin=box["stdin"], stdout=box["stdout"], stderr=box["stderr"], pass_fds=box["pass_fds"],
                start_new_session=True, preexec_fn=None if group is None else (lambda g=group: g.join(os.getpid())))
    except (OSError, subprocess.SubprocessError) as exc:
        status["error"] = f"could not start the sandbox: {type(exc).__name__}: {exc}"
    for fd in {fd for box in config["sandboxes"] for fd in (box["stdin"], box["stdout"], box["stderr"],
                                                              *box["pass_fds"])}:
        os.close(fd)  # the sandboxes hold their own copies: EOF must reach the parent when they end
    if status["error"] is None:
        _wait(config, procs, status, deadline)
    killed = set()
    for name, proc in procs.items():
        if proc.poll() is None:
            killed.add(name)
            _kill_group(proc.pid)
    for group in groups.values():
        group.kill_all()
    for name, proc in procs.items():
        proc.wait()
        entry = {"returncode": proc.returncode, "killed_by_watchdog": name in killed}
        if name in groups:
            entry["oom_kills"] = groups[name].oom_kills()
            entry["memory_peak"] = groups[name].memory_peak()
        status["sandboxes"][name] = entry
    for group in groups.values():
        group.remove()
    try:
        os.write(config["status_fd"], (json.dumps(status) + "\n").encode())
    except OSError:
        pass  # the caller is gone: the cleanup above is what mattered


def _wait(config: dict, procs: dict, status: dict, deadline: float) -> None:
    """Block until the primary sandbox exits, the wall clock runs out or the caller dies."""
    poller = select.poll()
    poller.register(config["lifeline_fd"], select.POLLIN | select.POLLHUP)
    pidfds = {}
    for name, proc in procs.items():
        fd = os.pidfd_open(proc.pid)
        pidfds[fd] = name
        poller.register(fd, select.POLLIN)
    exited, grace_until = set(), None
    while len(exited) < len(procs):
        if config["primary"] in exited and grace_until is None:  # the others (the candidate) end on EOF
            grace_until = time.monotonic() + _GRACE_S
        now = time.monotonic()
        if grace_until is not None and now >= grace_until:
            return
        left = deadline - now
        if left <= 0:
            status["timed_out"] = config["primary"] not in exited
            return
        if grace_until is not None:
            left = min(left, grace_until - now)
        for fd, _event in poller.poll(max(1, int(left * 1000))):
            if fd == config["lifeline_fd"]:
                status["caller_gone"] = True
                return
            poller.unregister(fd)
            exited.add(pidfds[fd])


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


if __name__ == "__main__":
    main()
