"""The sandbox's kernel layers: a bubblewrap command line, and a probe that refuses to run without any layer.

Each sandbox is `bwrap` (Debian package `bubblewrap`, installed by `make`) with:

- new pid, network (only a downed loopback), ipc, uts and cgroup namespaces; a new session; killed with its
  parent (`--die-with-parent`);
- a minimal root on an empty read-only tmpfs: the system's shared libraries (`/usr/lib`, `/usr/lib64` and
  the `/lib*` links), the interpreter binary, its shared library and standard library, and the caller's
  site-packages, all read-only; `/usr/bin` only when the run may start processes; nothing else of the host
  (no `/etc`, `/home`, `/root`, `/work`, `/sys`, no project files);
- a private `/dev` holding only null, zero, urandom and tty; a fresh `/proc` of the new pid namespace;
- a size-limited private tmpfs on `/tmp` (the disk quota), with the work directory `/tmp/work` in it;
- uid/gid 65534 (`setpriv`, with every capability and the bounding set dropped) when the caller is root,
  else the caller's own unprivileged uid in a user namespace; no_new_privs (bwrap sets it for seccomp);
- the seccomp filter of `sandbox_seccomp.py`.

`probe()` checks every layer once per process (bwrap present and able to start the interpreter as the
unprivileged uid, libseccomp, a cgroup hierarchy) and raises `SandboxUnavailableError` naming the first
missing one; `run_python(..., insecure=True)` is the documented opt-out for trusted code only.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
import threading
from dataclasses import dataclass

SANDBOX_UID = 65534  # "nobody": owns nothing on the host
WORK_DIR = "/tmp/work"
RUNNER_DIR = "/openk2-sandbox"
RUNNER_FILES = ("sandbox_child.py", "sandbox_judge.py", "sandbox_wire.py")
_DEVICES = ("null", "zero", "urandom", "tty")
_HERE = os.path.dirname(os.path.abspath(__file__))


class SandboxUnavailableError(RuntimeError):
    """A layer of the sandbox cannot be had here; untrusted code is refused (pass insecure=True for trusted code)."""


@dataclass(frozen=True)
class Jail:
    """What this machine offers, probed once: tool paths, the interpreter's files, the cgroup layout."""

    bwrap: str
    setpriv: str | None  # used when the caller is root, to drop to SANDBOX_UID
    python: str
    binds: tuple[str, ...]  # read-only, each at its own path
    site_paths: tuple[str, ...]
    cgroup_layout: dict
    layers: tuple[str, ...]

    def command(self, seccomp_fd: int, disk_mb: int, allow_processes: bool) -> list[str]:
        """The bwrap command line that runs the runner script (`python -I -B .../sandbox_child.py`)."""
        args = [self.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session"]
        if os.geteuid() != 0:
            args += ["--unshare-user", "--uid", str(os.getuid()), "--gid", str(os.getgid()), "--disable-userns"]
        else:
            args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                     "--cap-add", "CAP_SETPCAP"]  # only what setpriv needs to drop to SANDBOX_UID, then none
        binds = list(self.binds)
        if self.setpriv is not None and os.geteuid() == 0:
            binds.append(self.setpriv)
        if allow_processes:
            binds.append("/usr/bin")
        args += _root_tree(binds)
        args += ["--perms", "0755", "--dir", RUNNER_DIR]
        for name in RUNNER_FILES:
            args += ["--ro-bind", os.path.join(_HERE, name), f"{RUNNER_DIR}/{name}"]
        args += ["--proc", "/proc", "--perms", "0755", "--tmpfs", "/dev"]
        for name in _DEVICES:
            if os.path.exists(f"/dev/{name}"):
                args += ["--dev-bind", f"/dev/{name}", f"/dev/{name}"]
        for i, name in enumerate(("stdin", "stdout", "stderr")):
            args += ["--symlink", f"/proc/self/fd/{i}", f"/dev/{name}"]
        args += ["--symlink", "/proc/self/fd", "/dev/fd",
                 "--size", str(disk_mb << 20), "--perms", "1777", "--tmpfs", "/tmp",
                 "--perms", "0777", "--dir", WORK_DIR, "--chdir", WORK_DIR, "--remount-ro", "/",
                 "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORK_DIR,
                 "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8"]
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            args += ["--setenv", var, "1"]
        args += ["--seccomp", str(seccomp_fd), "--"]
        if os.geteuid() == 0:
            args += [self.setpriv, "--reuid", str(SANDBOX_UID), "--regid", str(SANDBOX_UID), "--clear-groups",
                     "--inh-caps", "-all", "--bounding-set", "-all", "--"]
        return args + [self.python, "-I", "-B", f"{RUNNER_DIR}/sandbox_child.py"]


def _root_tree(paths: list[str]) -> list[str]:
    """bwrap arguments binding each path read-only at itself, with world-readable parent directories."""
    args, made, bound = [], set(), []
    for link in ("/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            paths = [*paths, link]
    for path in sorted({os.path.realpath(p) for p in paths if os.path.exists(p)}, key=lambda p: (p.count("/"), p)):
        if any(path == b or path.startswith(b + "/") for b in bound):
            continue
        parent, missing = os.path.dirname(path), []
        while parent not in ("/", "") and parent not in made:
            missing.append(parent)
            parent = os.path.dirname(parent)
        for d in reversed(missing):
            args += ["--perms", "0755", "--dir", d]
            made.add(d)
        args += ["--ro-bind", path, path]
        bound.append(path)
    if "/bin" not in made and os.path.islink("/bin") and "/usr/bin" in bound:
        args += ["--symlink", os.readlink("/bin"), "/bin"]
    return args


def _interpreter_files() -> tuple[str, list[str], list[str]]:
    """The real interpreter binary, what it needs read-only (libs, stdlib), and the caller's site-packages."""
    python = os.path.realpath(sys.executable)
    paths = sysconfig.get_paths()
    base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
                                     "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix})
    binds = ["/usr/lib", "/usr/lib64", python, base["stdlib"], base["platstdlib"]]
    libdir, library = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
    if libdir and library and os.path.exists(os.path.join(libdir, library)):
        binds.append(os.path.join(libdir, library))
    project = os.path.dirname(os.path.dirname(_HERE))  # the source tree holding openk2: never visible
    site_paths = [p for p in dict.fromkeys([*site.getsitepackages(), paths["purelib"], paths["platlib"]])
                  if os.path.isdir(p) and not p.startswith(project + os.sep) and p != project]
    return python, binds + site_paths, site_paths


_PROBED: Jail | SandboxUnavailableError | None = None
_LOCK = threading.Lock()


def probe() -> Jail:
    """Every kernel layer, checked once per process; SandboxUnavailableError names the first one missing."""
    global _PROBED
    with _LOCK:
        if _PROBED is None:
            try:
                _PROBED = _probe()
            except SandboxUnavailableError as exc:
                _PROBED = exc
        if isinstance(_PROBED, SandboxUnavailableError):
            raise _PROBED
        return _PROBED


def _probe() -> Jail:
    from openk2.agentic.sandbox_cgroup import CgroupUnavailableError, plan
    from openk2.agentic.sandbox_seccomp import SeccompUnavailableError, seccomp_bpf

    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailableError("missing layer bubblewrap: no `bwrap` on PATH (apt-get install bubblewrap; "
                                      "`make` does this)")
    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and setpriv is None:
        raise SandboxUnavailableError("missing layer unprivileged-uid: the caller is root and util-linux `setpriv` "
                                      "is not on PATH to drop to uid 65534")
    try:
        program = seccomp_bpf(True)
    except SeccompUnavailableError as exc:
        raise SandboxUnavailableError(f"missing layer seccomp: {exc}") from exc
    try:
        layout = plan()
    except CgroupUnavailableError as exc:
        raise SandboxUnavailableError(f"missing layer cgroup: {exc}") from exc
    python, binds, site_paths = _interpreter_files()
    jail = Jail(bwrap, setpriv, python, tuple(binds), tuple(site_paths), layout, ())
    uid = SANDBOX_UID if os.geteuid() == 0 else os.getuid()
    check = f"import os, sys; sys.exit(0 if os.getuid() == {uid} and not os.listdir('/tmp/work') else 3)"
    read_fd, write_fd = os.pipe()
    os.write(write_fd, program)
    os.close(write_fd)
    try:
        command = jail.command(read_fd, 1, False)[:-1] + ["-c", check]
        done = subprocess.run(command, capture_output=True, pass_fds=(read_fd,), timeout=60, env={})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailableError(f"missing layer namespaces: bwrap did not start: {exc}") from exc
    finally:
        os.close(read_fd)
    if done.returncode != 0:
        why = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise SandboxUnavailableError(f"missing layer namespaces: bwrap cannot start the sandbox here: {why}")
    cgroup = f"cgroup-v{layout['version']}"
    layers = ("bwrap", "pidns", "netns", "ipcns", "utsns", "minimal-root", "private-dev", "tmpfs-quota",
              f"uid-{uid}", "no-capabilities", "no-new-privs", "seccomp", f"{cgroup}-memory", f"{cgroup}-pids",
              f"{cgroup}-cpu", "watchdog")
    return Jail(bwrap, setpriv, python, tuple(binds), tuple(site_paths), layout, layers)
