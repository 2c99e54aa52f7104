"""The sandbox end to end: results, limits and hostile code (more in test_sandbox_hostile.py), host left intact."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import textwrap
from pathlib import Path

import pytest

from openk2.agentic.sandbox import SandboxPool, run_python

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = textwrap.dedent("""
    def test_small():
        assert add(1, 2) == 3

    def test_negative():
        assert add(-1, -2) == -3

    def test_zero():
        assert add(0, 0) == 0
""")


def _children_of(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is `pid`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def _processes_running(marker: str) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.fixture(autouse=True)
def _host_left_clean():
    """Every run must leave no child process of the test process behind."""
    yield
    assert _children_of(os.getpid()) == []


def test_correct_solution_passes_with_counts():
    result = run_python(ADD + "print('loaded')", ADD_TESTS)
    assert (result.passed, result.failed, result.killed_reason, result.error) == (3, 0, None, None)
    assert result.ok and result.pass_rate == 1.0 and result.exit_code == 0
    assert result.stdout == "loaded\n"
    assert [t.name for t in result.tests] == ["test_small", "test_negative", "test_zero"]
    assert {"audit-hook", "rlimits", "seccomp", "bwrap", "judge-process", "watchdog"} <= set(result.isolation)


def test_wrong_solution_fails_with_counts_and_assertion_text():
    result = run_python("def add(a, b):\n    return a - b\n", ADD_TESTS)
    assert (result.passed, result.failed, result.killed_reason) == (1, 2, None)  # 0 - 0 == 0 passes
    failed = [t for t in result.tests if t.status == "failed"]
    assert {t.name for t in failed} == {"test_small", "test_negative"}
    assert "AssertionError" in failed[0].error and "add(1, 2) == 3" in failed[0].error
    assert not result.ok and result.pass_rate == pytest.approx(1 / 3)


def test_unittest_cases_and_import_from_solution_are_counted():
    tests = textwrap.dedent("""
        import unittest
        from solution import add

        class TestAdd(unittest.TestCase):
            def test_one(self):
                self.assertEqual(add(1, 1), 2)

            def test_wrong(self):
                self.assertEqual(add(1, 1), 3)

            def test_raises(self):
                raise KeyError("boom")
    """)
    result = run_python(ADD, tests)
    statuses = {t.name: t.status for t in result.tests}
    assert statuses == {"TestAdd.test_one": "passed", "TestAdd.test_wrong": "failed", "TestAdd.test_raises": "error"}
    assert (result.passed, result.failed) == (1, 2)


def test_syntax_error_is_reported_cleanly_and_fails_every_test():
    result = run_python("def add(a, b)\n    return a + b\n", ADD_TESTS)
    assert result.killed_reason is None
    assert result.error is not None and "SyntaxError" in result.error and "solution.py" in result.error
    assert (result.passed, result.failed) == (0, 3)
    assert {t.status for t in result.tests} == {"error"}


def test_stdin_and_no_tests():
    result = run_python("import sys\nprint(sum(map(int, sys.stdin.read().split())))", stdin="1 2 39")
    assert result.stdout == "42\n" and result.ok and result.total == 0


def test_infinite_loop_stopped_by_wall_clock_with_earlier_tests_kept():
    tests = "def test_fine():\n    assert True\n\ndef test_hangs():\n    while True:\n        pass\n"
    result = run_python("", tests, timeout_s=1.5)
    assert result.killed_reason == "wall-time limit 1.5 s exceeded"
    assert (result.passed, result.failed) == (1, 1)
    assert result.duration_s < 4.0


def test_cpu_time_limit_kills_busy_code():
    result = run_python("while True:\n    pass\n", timeout_s=8, cpu_time_s=1)
    assert result.killed_reason == "CPU-time limit 1 s exceeded"
    assert result.duration_s < 6.0


def test_fork_bomb_is_denied_and_leaves_no_process():
    result = run_python("import os\nwhile True:\n    os.fork()\n", timeout_s=5)
    assert result.killed_reason is not None and result.killed_reason.startswith("process limit")
    result = run_python("import subprocess\nsubprocess.run(['true'])", timeout_s=5)
    assert result.killed_reason.startswith("process limit: subprocess.Popen denied")


def test_pids_cgroup_caps_processes_the_audit_hook_cannot_see(tmp_path):
    # A shell started through the one permitted child process forks without the audit hook; the per-run
    # pids cgroup (layer 3) must cap it, and the cleanup must reap even daemons that left the session.
    marker = "31.4159"
    shell = f"for i in $(seq 80); do setsid sleep {marker} & done"
    code = f"import subprocess\nsubprocess.run(['/bin/sh', '-c', {shell!r}])"
    result = run_python(code, timeout_s=4, max_processes=1)
    assert any(layer.endswith("-pids") for layer in result.isolation)
    assert "fork" in result.stderr.lower()  # the shell reports the forks the cgroup refused
    assert _processes_running(f"sleep {marker}") == []


def test_memory_hog_is_stopped_with_memory_reason():
    result = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(50 << 20))\n", memory_mb=256)
    assert result.killed_reason == "memory limit exceeded (MemoryError)"
    big = run_python("def big():\n    return len(bytearray(1 << 30))\n", "def test_big():\n    big()\n",
                     memory_mb=256)
    assert big.killed_reason == "memory limit exceeded (MemoryError)" and big.failed == 1


def test_large_file_write_hits_file_size_limit():
    code = "with open('big.bin', 'wb') as f:\n    for _ in range(8):\n        f.write(bytes(1 << 20))\n"
    result = run_python(code, max_file_mb=2)
    assert result.killed_reason == "file-size limit 2 MB exceeded"


def test_network_connection_to_host_listener_is_blocked():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')"
        result = run_python(code, timeout_s=5)
        assert result.killed_reason is not None and result.killed_reason.startswith("network access denied")
        with pytest.raises(TimeoutError):
            server.accept()


def test_kernel_layers_stop_code_outside_the_audit_hook(tmp_path):
    # A plain interpreter started as a permitted child process has no audit hook: only the network namespace
    # and the read-only mounts stand between it and the host's listener and files.
    target = tmp_path / "escaped-by-child.txt"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        probe = (f"import socket; print(socket.socket().connect_ex(('127.0.0.1', {port})))\n"
                 f"try:\n    open({str(target)!r}, 'w')\nexcept OSError as e:\n    print(e.strerror)")
        code = f"import subprocess\nsubprocess.run(['/usr/bin/python3', '-c', {probe!r}])"
        result = run_python(code, timeout_s=5, max_processes=1)
        assert "netns" in result.isolation
        connect_errno, *write_error = result.stdout.splitlines()
        assert result.killed_reason is None and connect_errno != "0"  # an errno such as ENETUNREACH
        with pytest.raises(TimeoutError):
            server.accept()
    assert write_error == ["No such file or directory"]  # the host's directories are not in the sandbox
    assert not target.exists()


def test_writing_outside_the_sandbox_is_denied(tmp_path):
    target = tmp_path / "escaped.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('pwned')")
    assert result.killed_reason == f"write outside the sandbox directory denied ({target})"
    assert not target.exists()
    result = run_python(f"import os\nos.symlink({str(tmp_path)!r}, 'link')\nopen('link/escaped.txt', 'w')")
    assert result.killed_reason.startswith("write outside the sandbox directory denied")
    assert not target.exists()


def test_callers_environment_is_invisible(monkeypatch):
    secret = "openk2-sandbox-test-secret-6f1d"
    monkeypatch.setenv("OPENK2_SANDBOX_SECRET", secret)
    result = run_python("import os\nprint(dict(os.environ))\nprint(open('/proc/self/environ').read())")
    assert result.killed_reason is None and "HOME" in result.stdout
    assert secret not in result.stdout and "OPENK2_SANDBOX_SECRET" not in result.stdout
    result = run_python("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())")
    assert result.killed_reason.startswith("reading another process's /proc entry denied")
    assert secret not in result.stdout


def test_callers_home_directory_is_hidden():
    with tempfile.NamedTemporaryFile("w", dir=Path.home(), prefix=".openk2-sandbox-test-") as secret_file:
        secret_file.write("api-key-in-home")
        secret_file.flush()
        code = f"import os\nprint(os.path.exists({secret_file.name!r}))"
        result = run_python(code)
    assert result.killed_reason is None and result.stdout.splitlines()[0] == "False"


def test_private_directory_is_removed_and_output_is_capped():
    result = run_python("import os\nprint(os.getcwd())\nprint('x' * 500_000)", max_output_bytes=1000)
    assert result.stdout.splitlines()[0] == "/tmp/work"  # in the run's private tmpfs: gone with the run
    assert result.output_truncated and len(result.stdout) == 1000


def test_ctypes_is_unavailable_but_numpy_still_imports():
    result = run_python("import numpy\nprint(int(numpy.arange(4).sum()))\nimport ctypes", memory_mb=1024)
    assert result.stdout == "6\n"
    assert result.error is not None and "ctypes is disabled in the sandbox" in result.error


def test_bad_limits_raise_value_error():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("pass", memory_mb=1)


def test_pool_runs_jobs_in_order_and_async():
    jobs = [{"code": f"print({i})"} for i in range(4)]
    with SandboxPool(max_concurrency=2) as pool:
        results = pool.map(jobs)
        assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"]

        async def both():
            return await asyncio.gather(pool.run(ADD, ADD_TESTS), pool.run("raise SystemExit(3)"))

        good, exited = asyncio.run(both())
    assert good.passed == 3 and exited.error == "SystemExit: 3"


def test_judge_sees_only_plain_values_and_handles():
    code = textwrap.dedent("""
        LIMIT = 3
        class Box:
            def __init__(self, v):
                self.v = v
            def get(self):
                return (self.v, [self.v], {"k": {self.v}})
        def make(v):
            return Box(v)
        def boom():
            raise KeyError("missing")
    """)
    tests = textwrap.dedent("""
        import pytest_free_check as _unused  # noqa: a failing import in the tests is an error, reported below
    """)
    broken = run_python(code, tests)
    assert broken.error is not None and "ModuleNotFoundError" in broken.error
    tests = textwrap.dedent("""
        from solution import make
        def test_values():
            box = make(2)
            assert box.get() == (2, [2], {"k": {2}}) and type(box.get()[0]) is int and LIMIT == 3
        def test_handle_compares_by_identity():
            assert make(1) != make(1) and repr(make(1)) == "<the code's Box>"
        def test_builtin_exception_crosses():
            try:
                boom()
            except KeyError as exc:
                assert "missing" in str(exc)
            else:
                raise AssertionError("no KeyError")
    """)
    result = run_python(code, tests)
    assert (result.passed, result.failed) == (3, 0), result.tests
