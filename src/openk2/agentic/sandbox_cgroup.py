"""Per-run cgroups for the sandbox: memory (all processes together), task count and CPU bandwidth.

cgroup v2 first: one leaf `<parent>/openk2-sandbox/<run>` with `memory.max`, `memory.swap.max = 0`,
`pids.max` and `cpu.max`. The parent is `$OPENK2_SANDBOX_CGROUP` when set (a delegated subtree, see
docs/sandbox.md), else the caller's own cgroup when that is the hierarchy's root (v2 forbids controllers
below a cgroup that holds processes, the root excepted). Else cgroup v1: one `openk2-sandbox/<run>` below the
caller's own cgroup in each of the memory, pids and cpu hierarchies (`memory.limit_in_bytes` and
`memory.memsw.limit_in_bytes`, `pids.max`, `cpu.cfs_quota_us`), so the caller's own limits still bound it.
Neither: `CgroupUnavailableError` saying what was tried; the sandbox then refuses to run (no silent drop).

Standard library only: the watchdog (`sandbox_watchdog.py`, started by path) imports this file too.
"""

from __future__ import annotations

import os
import secrets
import signal
import time

ENV_PARENT = "OPENK2_SANDBOX_CGROUP"
BASE = "openk2-sandbox"
CPU_PERIOD_US = 100_000
_V2_CONTROLLERS = ("memory", "pids", "cpu")


class CgroupUnavailableError(RuntimeError):
    """No cgroup hierarchy here can take the sandbox's memory, pids and cpu limits."""


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(fstype, mount point, super options) of every cgroup mount, from /proc/self/mountinfo."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                found.append((tail[0], fields[4].replace("\\040", " "), set(tail[2].split(","))))
    return found


def _own_paths() -> tuple[str | None, dict[str, str]]:
    """The caller's v2 cgroup path and, per v1 controller, its v1 cgroup path (from /proc/self/cgroup)."""
    v2, v1 = None, {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            hid, controllers, path = line.rstrip("\n").split(":", 2)
            if hid == "0" and not controllers:
                v2 = path
            for name in controllers.split(","):
                v1[name] = path
    return v2, v1


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def plan() -> dict:
    """Where per-run cgroups go here: {"version": 2, "base": dir} or {"version": 1, "bases": {ctrl: dir}}.

    Creates the `openk2-sandbox` base directories (enabling v2 controllers on the way); raises
    CgroupUnavailableError naming each hierarchy tried and why it failed."""
    mounts = _mounts()
    own_v2, own_v1 = _own_paths()
    tried = []
    for fstype, point, _opts in mounts:
        if fstype != "cgroup2":
            continue
        try:
            available = _read(os.path.join(point, "cgroup.controllers")).split()
        except OSError as exc:
            tried.append(f"v2 at {point}: {exc.strerror}")
            continue
        missing = [c for c in _V2_CONTROLLERS if c not in available]
        if missing:
            tried.append(f"v2 at {point}: controllers {', '.join(missing)} not available (bound to v1?)")
            continue
        parent = os.environ.get(ENV_PARENT) or (point if own_v2 in ("/", "") else None)
        if parent is None:
            tried.append(f"v2 at {point}: the caller's cgroup {own_v2} is not the root and ${ENV_PARENT} is unset")
            continue
        try:
            return {"version": 2, "base": _v2_base(parent)}
        except OSError as exc:
            tried.append(f"v2 below {parent}: {exc.strerror or exc}")
    bases, problems = {}, []
    for controller in ("memory", "pids", "cpu"):
        point = next((p for t, p, opts in mounts if t == "cgroup" and controller in opts), None)
        if point is None:
            problems.append(f"{controller} not mounted")
            continue
        base = os.path.join(point, own_v1.get(controller, "/").lstrip("/"), BASE)
        try:
            os.makedirs(base, exist_ok=True)
        except OSError as exc:
            problems.append(f"{controller}: cannot create {base}: {exc.strerror}")
            continue
        bases[controller] = base
    if not problems:
        return {"version": 1, "bases": bases}
    tried.append("v1: " + "; ".join(problems))
    raise CgroupUnavailableError("no cgroup can hold the memory, pids and cpu limits: " + " | ".join(tried))


def _v2_base(parent: str) -> str:
    """`<parent>/openk2-sandbox` with memory, pids and cpu enabled for its children."""
    enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
    if any(c not in enabled for c in _V2_CONTROLLERS):
        _write(os.path.join(parent, "cgroup.subtree_control"), " ".join(f"+{c}" for c in _V2_CONTROLLERS))
    base = os.path.join(parent, BASE)
    os.makedirs(base, exist_ok=True)
    if any(c not in _read(os.path.join(base, "cgroup.subtree_control")).split() for c in _V2_CONTROLLERS):
        _write(os.path.join(base, "cgroup.subtree_control"), " ".join(f"+{c}" for c in _V2_CONTROLLERS))
    return base


class RunCgroup:
    """One run's cgroup(s): join, list, kill everything in them, read OOM kills and peak memory, remove."""

    def __init__(self, layout: dict, name: str) -> None:
        self.version = layout["version"]
        self.dirs = ([os.path.join(layout["base"], name)] if self.version == 2 else
                     [os.path.join(base, name) for base in layout["bases"].values()])
        self._memory_dir = self.dirs[0] if self.version == 2 else os.path.join(layout["bases"]["memory"], name)

    @classmethod
    def create(cls, layout: dict, memory_bytes: int, max_tasks: int, cpus: float, owner_pid: int) -> RunCgroup:
        """Make the run's cgroup(s) and set every limit; OSError (after removing them) when one fails."""
        _sweep(layout)
        run = cls(layout, f"w{owner_pid}-{secrets.token_hex(6)}")
        quota = max(1000, int(cpus * CPU_PERIOD_US))
        try:
            for d in run.dirs:
                os.mkdir(d)
            if run.version == 2:
                d = run.dirs[0]
                _write(os.path.join(d, "memory.max"), str(memory_bytes))
                if os.path.exists(os.path.join(d, "memory.swap.max")):
                    _write(os.path.join(d, "memory.swap.max"), "0")
                _write(os.path.join(d, "pids.max"), str(max_tasks))
                _write(os.path.join(d, "cpu.max"), f"{quota} {CPU_PERIOD_US}")
            else:
                bases = layout["bases"]
                mem = os.path.join(bases["memory"], os.path.basename(run.dirs[0]))
                _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
                if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):  # no swap either
                    _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                pids = os.path.join(bases["pids"], os.path.basename(run.dirs[0]))
                _write(os.path.join(pids, "pids.max"), str(max_tasks))
                cpu = os.path.join(bases["cpu"], os.path.basename(run.dirs[0]))
                _write(os.path.join(cpu, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
                _write(os.path.join(cpu, "cpu.cfs_quota_us"), str(quota))
        except OSError:
            run.remove()
            raise
        return run

    def join(self, pid: int) -> None:
        """Move process `pid` (0: the caller) into every hierarchy of this run."""
        for d in self.dirs:
            _write(os.path.join(d, "cgroup.procs"), str(pid))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                found.update(int(line) for line in _read(os.path.join(d, "cgroup.procs")).split())
            except (OSError, ValueError):
                continue
        return found

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process in the run (daemons that left the session too) until none is left."""
        if self.version == 2:
            try:
                _write(os.path.join(self.dirs[0], "cgroup.kill"), "1")  # Linux 5.14+: atomic
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.005)

    def oom_kills(self) -> int:
        """How many processes the kernel killed for hitting this run's memory limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in _read(os.path.join(self._memory_dir, name)).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def memory_peak(self) -> int | None:
        """Peak bytes charged to the run (processes, page cache and tmpfs together), where the kernel says."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(_read(os.path.join(self._memory_dir, name)))
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(200):  # a just-killed task leaves the cgroup a moment after it dies
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)


def _sweep(layout: dict) -> None:
    """Remove run cgroups whose watchdog is gone (it was SIGKILLed before it could clean up)."""
    bases = [layout["base"]] if layout["version"] == 2 else list(layout["bases"].values())
    for base in bases:
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            owner = name[1:].partition("-")[0]
            if not (name.startswith("w") and owner.isdigit()) or os.path.exists(f"/proc/{owner}"):
                continue
            stale = RunCgroup({"version": 2, "base": base}, name)  # one directory per base is enough here
            stale.kill_all(timeout_s=1.0)
            stale.remove()
