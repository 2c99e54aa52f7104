"""The sandboxed runners' entry point and the candidate role: run the untrusted code, then answer calls.

`openk2.agentic.sandbox` starts this file as a script, `python -I -B <runner dir>/sandbox_child.py`, inside
the kernel layers (bubblewrap, seccomp, cgroups: docs/sandbox.md). The parent writes one JSON config to
stdin; its `role` picks what the process does:

  candidate  runs the code as module `__main__` under rlimits and the audit hook below, reports a load error
             (if any) on `report_fd`, then, when a judge exists, answers its requests on `call_in`/`call_out`
             (`sandbox_wire` frames: look up a name, call a function, read an attribute) until the judge
             hangs up. It never sees the tests and reports no test result.
  judge      `sandbox_judge.py`: runs the tests in its own sandbox against handles to the candidate and
             reports each outcome; the only source of a reward.

In-process layers of the candidate (defence in depth; the kernel layers are the wall):

  rlimits      CPU seconds, address space, file size, open files, (non-root) processes; no core files
  audit hook   denies sockets, process creation beyond max_processes, exec, hand-made code objects, gc
               object walks, writes outside the sandbox directory, reading other processes' /proc entries and
               signals to processes other than itself and its children: a violation ends the run at once with
               its reason. Importing ctypes or cffi raises ImportError instead (libraries fall back without it)

Report lines are JSON with a nonce. Standard library only (plus `sandbox_wire.py` beside this file):
`-I` leaves this directory off sys.path, so the runner adds it just long enough to import the wire.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

SOLUTION_FILE = "solution.py"  # the code runs as module __main__ (also importable as `solution`) from this file
TESTS_FILE = "test_solution.py"
_ERROR_CHARS = 2000  # per-error text kept in results


def _child_main() -> None:
    config = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    report_fd, nonce = config["report_fd"], config["nonce"]

    def report(event: str, **fields: Any) -> None:
        os.write(report_fd, (json.dumps({"nonce": nonce, "event": event, **fields}) + "\n").encode())

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import sandbox_wire

    sys.path.remove(here)
    sys.path.extend(config.get("extra_paths", []))  # the interpreter's site-packages, bound read-only
    _set_rlimits(config["limits"], config["cpu_seconds"])
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # CPython ignores it; a kill names the file-size limit clearly
    os.chdir(config["root"])
    if config["role"] == "judge":
        sys.path.insert(0, here)
        import sandbox_judge

        sys.path.remove(here)
        sandbox_judge.judge_main(config, report, sandbox_wire)
    else:
        _candidate_main(config, report, sandbox_wire)
    _flush_std_streams()
    report("done")
    os._exit(0)  # neither the code's leftover threads nor its atexit handlers may hold the run past its result


def _candidate_main(config: dict, report: Any, wire: Any) -> None:
    """Load the code under the audit hook, then serve the judge (if any) until it hangs up."""
    import io
    import types

    def violation(reason: str) -> None:
        report("killed", reason=reason)
        _flush_std_streams()
        os._exit(111)

    sys.stdin = io.StringIO(config["stdin"])
    root = config["root"]
    with open(os.path.join(root, SOLUTION_FILE), "w") as f:  # on disk so tracebacks can show source lines
        f.write(config["code"])
    report("layers", layers=["rlimits", "audit-hook"])
    _install_audit_hook(root, config["limits"]["max_processes"], violation)
    module = types.ModuleType("__main__")
    module.__file__ = SOLUTION_FILE
    sys.modules["__main__"] = sys.modules["solution"] = module
    load_error = _exec_file(config["code"], SOLUTION_FILE, module.__dict__, violation)
    if load_error:
        report("error", error=load_error)
    if config.get("call_in") is not None:
        _serve(module.__dict__, load_error, config["call_in"], config["call_out"], wire, violation)


def _serve(namespace: dict, load_error: str | None, call_in: int, call_out: int, wire: Any, violation: Any) -> None:
    """Answer the judge's requests: names, get, call, getattr, list, len. Values cross as `sandbox_wire` data."""
    refs: list = []

    def out(value: Any) -> Any:
        return wire.encode(value, refs)

    def arg(data: Any) -> Any:
        return wire.decode(data, lambda i, _t: refs[i] if 0 <= i < len(refs) else None)

    def answer(request: dict) -> dict:
        op = request.get("op")
        if op == "names":
            names = [n for n, v in namespace.items()
                     if not n.startswith("__") and not isinstance(v, type(sys))]
            return {"value": out({"names": names, "load_error": load_error})}
        if op == "get":
            name = request.get("name")
            if name not in namespace:
                raise NameError(f"the code defines no {name!r}")
            return {"value": out(namespace[name])}
        target = refs[request["ref"]] if type(request.get("ref")) is int and request["ref"] < len(refs) else None
        if target is None:
            raise LookupError("unknown handle")
        if op == "call":
            args = [arg(a) for a in request.get("args", [])]
            kwargs = {str(k): arg(v) for k, v in request.get("kwargs", [])}
            return {"value": out(target(*args, **kwargs))}
        if op == "getattr":
            return {"value": out(getattr(target, str(request.get("attr"))))}
        if op == "list":
            return {"value": out(list(target))}
        if op == "len":
            return {"value": out(len(target))}
        raise ValueError(f"unknown request {op!r}")

    while True:
        try:
            request = wire.receive(call_in)
        except (wire.WireError, OSError):
            return  # the judge is done (or gone): nothing more to answer
        start = time.monotonic()
        try:
            reply = answer(request)
        except MemoryError:
            violation("memory limit exceeded (MemoryError)")
        except BaseException as exc:  # noqa: BLE001 - the code's exception is the answer, SystemExit included
            reply = {"raised": {"type": type(exc).__name__, "message": _exception_text(exc),
                                "builtin": type(exc).__module__ == "builtins"}}
        reply["seconds"] = round(time.monotonic() - start, 6)
        try:
            wire.send(call_out, reply)
        except (TypeError, ValueError, wire.WireError) as exc:
            wire.send(call_out, {"raised": {"type": "TypeError", "builtin": True,
                                            "message": f"the code's answer cannot be sent: {exc}"}})
        except OSError:
            return


def _exception_text(exc: BaseException) -> str:
    try:
        return str(exc)[:_ERROR_CHARS]
    except BaseException:  # noqa: BLE001 - a hostile __str__ must not break the channel
        return "<unprintable>"


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):  # the code may have swapped them
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or replaced stream must not cost the run its report
            pass


def _set_rlimits(limits: dict[str, Any], cpu_seconds: int) -> None:
    import resource

    mb = 1 << 20
    wanted = {resource.RLIMIT_CPU: (cpu_seconds, cpu_seconds + 1),  # SIGXCPU at soft, SIGKILL at hard
              resource.RLIMIT_AS: (limits["memory_mb"] * mb,) * 2,
              resource.RLIMIT_FSIZE: (limits["max_file_mb"] * mb,) * 2,
              resource.RLIMIT_NOFILE: (limits["max_open_files"],) * 2,
              resource.RLIMIT_CORE: (0, 0)}
    for which, value in wanted.items():
        resource.setrlimit(which, value)


def _exec_file(source: str, filename: str, namespace: dict, violation: Any) -> str | None:
    """Compile and run one source file in `namespace`; the formatted exception, or None."""
    try:
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - running the code is the point
    except SystemExit as exc:
        return None if exc.code in (None, 0) else f"SystemExit: {exc.code}"
    except MemoryError:
        violation("memory limit exceeded (MemoryError)")
    except BaseException as exc:  # noqa: BLE001 - any failure of the code is a result, not a crash
        return _format_exception(exc)
    return None


def _format_exception(exc: BaseException) -> str:
    """The traceback without the runner's own frames, cut to the last _ERROR_CHARS characters."""
    import traceback

    tb = exc.__traceback__
    while tb is not None and os.path.dirname(tb.tb_frame.f_code.co_filename) == os.path.dirname(__file__):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb)).strip()[-_ERROR_CHARS:]


_NETWORK_EVENTS = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
                             "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"})
_PROCESS_EVENTS = frozenset({"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.system"})
# event -> (index of a path argument, index of its dir_fd argument or None), per CPython's posixmodule.c
_PATH_WRITE_EVENTS = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
                      "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),),
                      "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.mkfifo": ((0, 2),),
                      "os.mknod": ((0, 3),), "os.truncate": ((0, None),), "os.setxattr": ((0, None),),
                      "os.removexattr": ((0, None),)}
# ctypes, cffi and hand-made code objects can rewrite interpreter memory and so switch this hook off; gc's
# object walks find the runner's state. None of them has a use in a coding task worth that hole.
_DENIED_EVENTS = {"code.__new__": "constructing code objects", "gc.get_objects": "gc object walks",
                  "gc.get_referrers": "gc object walks", "gc.get_referents": "gc object walks",
                  "os.exec": "exec (replacing the sandboxed interpreter)", "sys._current_frames": "frame access"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _install_audit_hook(root: str, max_processes: int, violation: Any) -> None:
    """Deny what the kernel layers may not cover (they may be absent); see the module docstring."""
    import types

    realpath, join, fsdecode, my_pid = os.path.realpath, os.path.join, os.fsdecode, os.getpid()
    types_file = types.__file__
    spawned = [0]
    busy = threading.local()

    def outside(path: Any, dir_fd: Any = None) -> str | None:
        """The resolved path when it lies outside the sandbox directory, else None."""
        if isinstance(path, int):
            return None  # an fd the code already holds
        path = fsdecode(path)
        if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):  # audit passes None as -1
            path = join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        resolved = realpath(path)
        inside = resolved == root or resolved.startswith(root + os.sep) or resolved == os.devnull
        return None if inside else resolved

    def check(event: str, args: tuple) -> None:
        if event == "open":
            path, _, flags = args
            if isinstance(flags, int) and flags & _WRITE_FLAGS and (where := outside(path)):
                violation(f"write outside the sandbox directory denied ({where})")
            if not isinstance(path, int) and _other_process_proc_path(fsdecode(path), my_pid):
                violation(f"reading another process's /proc entry denied ({fsdecode(path)})")
        elif event in _PATH_WRITE_EVENTS:
            for path_at, dir_fd_at in _PATH_WRITE_EVENTS[event]:
                if where := outside(args[path_at], None if dir_fd_at is None else args[dir_fd_at]):
                    violation(f"{event} outside the sandbox directory denied ({where})")
        elif event in _NETWORK_EVENTS:
            target = args[:2] if event.startswith("socket.get") else args[1]  # (host, port) or the socket's address
            violation(f"network access denied ({event} to {target})")
        elif event in _PROCESS_EVENTS:
            spawned[0] += 1
            if spawned[0] > max_processes:
                violation(f"process limit: {event} denied (at most {max_processes} child processes)")
        elif event in ("os.kill", "os.killpg") and args[0] not in (my_pid, 0) and not _is_child_of(args[0], my_pid):
            violation(f"{event} of a process other than itself or its children denied")
        elif event == "import" and args[0] in ("ctypes", "_ctypes", "cffi", "_cffi_backend"):
            raise ImportError(f"{args[0]} is disabled in the sandbox")  # libraries like numpy fall back without it
        elif event == "code.__new__" and sys._getframe(2).f_code.co_filename == types_file:
            return  # types.coroutine only flips a flag on an existing function (asyncio needs it)
        elif event in _DENIED_EVENTS:
            violation(f"{_DENIED_EVENTS[event]} denied ({event})")

    def hook(event: str, args: tuple) -> None:
        if getattr(busy, "on", False):  # realpath and friends inside the check must not recurse
            return
        busy.on = True
        try:
            check(event, args)
        except ImportError:
            raise
        except Exception as exc:  # noqa: BLE001 - fail closed: an unjudgeable event ends the run
            violation(f"sandbox policy could not check {event}: {type(exc).__name__}: {exc}")
        finally:
            busy.on = False

    sys.addaudithook(hook)


def _is_child_of(pid: int, parent: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == parent
    except (OSError, ValueError, IndexError):
        return False


def _other_process_proc_path(path: str, my_pid: int) -> bool:
    """True for /proc/<pid>/... of a process other than this one (its environ, cmdline, memory)."""
    parts = os.path.normpath(path).split(os.sep)
    return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and int(parts[2]) != my_pid


if __name__ == "__main__":
    _child_main()
