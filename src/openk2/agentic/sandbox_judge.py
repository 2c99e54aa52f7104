"""The judge role: run the tests in a sandbox of their own against handles to the candidate's code.

Started by `sandbox_child.py` (role "judge") in a second bubblewrap sandbox; the candidate's process is
reachable only through two pipes of `sandbox_wire` frames, so nothing the code does (frame walks,
monkeypatching builtins or unittest, editing files, exiting early, signals) can touch this interpreter, its
tests or its report pipe. The test namespace holds:

- with `entry_points` (HumanEval, the RL code task): the trusted `setup` code (HumanEval's prompt: helper
  functions such as `poly` stay the dataset's own), then a handle for each entry point;
- without: a handle or a plain copy of each top-level name of the code (functions, classes, constants), then
  `setup`; `from solution import f` works through a `solution` module of the same handles.

A handle's call sends plain arguments and receives a plain value (built-in types only, decoded here) or the
name and message of what the code raised (a built-in exception type is re-raised as itself, anything else as
`CandidateError`), so every comparison in a test is between built-in objects, with this interpreter's `==`.
Standard library only; imports the wire beside it.
"""

from __future__ import annotations

import builtins
import sys
import time
import types
from typing import Any

from sandbox_child import _ERROR_CHARS, TESTS_FILE, _exec_file, _format_exception


class CandidateError(RuntimeError):
    """The code raised a non-built-in exception, sent something malformed, or its process is gone."""


class _Channel:
    """Requests to the candidate; once it is gone every later request fails at once with the same reason."""

    def __init__(self, call_out: int, call_in: int, wire: Any) -> None:
        self.call_out, self.call_in, self.wire, self.gone = call_out, call_in, wire, None

    def request(self, **message: Any) -> Any:
        if self.gone:
            raise CandidateError(self.gone)
        try:
            self.wire.send(self.call_out, message)
            reply = self.wire.receive(self.call_in)
        except (OSError, self.wire.WireError) as exc:
            self.gone = f"the code's process ended or broke the channel ({exc})"
            raise CandidateError(self.gone) from None
        if "raised" in reply:
            _reraise(reply["raised"])
        try:
            return self.wire.decode(reply.get("value"), lambda i, t: Handle(self, i, t))
        except (self.wire.WireError, TypeError, ValueError) as exc:  # e.g. an unhashable dict key
            raise CandidateError(f"the code answered with a malformed value: {exc}") from None


def _reraise(raised: Any) -> None:
    if type(raised) is not dict:
        raise CandidateError("the code answered with a malformed exception")
    name, message = str(raised.get("type", "?"))[:100], str(raised.get("message", ""))[:_ERROR_CHARS]
    kind = getattr(builtins, name, None) if raised.get("builtin") is True else None
    if isinstance(kind, type) and issubclass(kind, Exception) and kind is not StopIteration:
        raise kind(message)
    raise CandidateError(f"the code raised {name}: {message}")


class Handle:
    """An object of the candidate: call it, read its attributes, iterate it; it compares only by identity."""

    __slots__ = ("_channel", "_id", "_type")

    def __init__(self, channel: _Channel, ref: int, type_name: str) -> None:
        self._channel, self._id, self._type = channel, ref, type_name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._channel.request(op="call", ref=self._id, args=[_plain(a) for a in args],
                                     kwargs=[[k, _plain(v)] for k, v in kwargs.items()])

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return self._channel.request(op="getattr", ref=self._id, attr=attr)

    def __iter__(self) -> Any:
        return iter(self._channel.request(op="list", ref=self._id))

    def __len__(self) -> int:
        value = self._channel.request(op="len", ref=self._id)
        if type(value) is not int:
            raise CandidateError("the code's __len__ answered a non-int")
        return value

    def __repr__(self) -> str:
        return f"<the code's {self._type}>"


def _plain(value: Any) -> Any:
    """Arguments go to the candidate as plain data; a Handle goes back as its ref."""
    from sandbox_wire import encode

    if isinstance(value, Handle):
        return {"$": "ref", "id": value._id, "type": value._type}
    if isinstance(value, (list, tuple, set, frozenset, dict)) and _holds_handle(value):
        raise TypeError("containers holding the code's objects cannot be sent back to it")
    return encode(value)


def _holds_handle(value: Any) -> bool:
    items = value.items() if isinstance(value, dict) else value
    return any(isinstance(v, Handle) or (isinstance(v, (list, tuple, set, frozenset, dict)) and _holds_handle(v))
               for v in (x for pair in items for x in (pair if isinstance(value, dict) else (pair,))))


def judge_main(config: dict, report: Any, wire: Any) -> None:
    """Build the test namespace, run every collected test and report each outcome."""
    channel = _Channel(config["call_out"], config["call_in"], wire)
    with open(TESTS_FILE, "w") as f:
        f.write(config["tests"])

    def violation(reason: str) -> None:
        report("error", error=f"the tests themselves failed: {reason}")

    load_error, not_run = None, "the code failed to load"
    try:
        hello = channel.request(op="names")
        names, load_error = list(hello["names"]), hello["load_error"]
    except (CandidateError, KeyError, TypeError, ValueError) as exc:
        names, load_error = [], f"the code did not answer the judge: {exc}"
        not_run = load_error
    namespace: dict[str, Any] = {"__name__": "test_solution", "__file__": TESTS_FILE}
    solution = types.ModuleType("solution")
    entry_points = config.get("entry_points")
    if entry_points is None:
        for name in names:
            if isinstance(name, str) and name.isidentifier():
                try:
                    namespace[name] = channel.request(op="get", name=name)
                except (CandidateError, Exception):  # noqa: BLE001 - a name that will not cross stays out
                    continue
    if config.get("setup"):
        setup_error = _exec_file(config["setup"], "setup.py", namespace, violation)
        if setup_error:
            report("error", error=f"in the test setup: {setup_error}")
            return
    for name in entry_points or []:
        try:
            namespace[name] = channel.request(op="get", name=name)
        except CandidateError as exc:
            namespace[name] = _missing(name, str(exc))
        except NameError as exc:
            namespace[name] = _missing(name, str(exc))
    solution.__dict__.update({k: v for k, v in namespace.items() if not k.startswith("__")})
    sys.modules["solution"] = solution
    tests_error = _exec_file(config["tests"], TESTS_FILE, namespace, violation)
    if tests_error:
        report("error", error=(load_error + "\n" if load_error else "") + f"in the tests: {tests_error}")
        return
    cases = _collect_tests(namespace)
    report("collected", names=[name for name, _ in cases])
    for name, case in cases:
        if load_error:
            report("test", name=name, status="error", error=not_run)
            continue
        start = time.monotonic()
        status, error = case()
        report("test", name=name, status=status, error=error, duration_s=round(time.monotonic() - start, 4))


def _missing(name: str, reason: str) -> Any:
    def missing(*_args: Any, **_kwargs: Any) -> Any:
        raise NameError(f"{name}: {reason}")

    return missing


def _collect_tests(namespace: dict) -> list[tuple[str, Any]]:
    """`test*` functions defined in the tests file, then unittest.TestCase methods, in definition order."""
    unittest = sys.modules.get("unittest")  # tests with TestCases imported it; others skip its ~50 ms import
    cases = []
    for name, obj in list(namespace.items()):
        defined_here = getattr(getattr(obj, "__code__", None), "co_filename", None) == TESTS_FILE
        if name.startswith("test") and callable(obj) and defined_here:
            cases.append((name, lambda fn=obj: _call_test(fn)))
        elif unittest and isinstance(obj, type) and issubclass(obj, unittest.TestCase):
            if obj.__module__ != "test_solution":
                continue  # imported from elsewhere: not one of these tests
            for test in unittest.defaultTestLoader.loadTestsFromTestCase(obj):
                cases.append((f"{name}.{test._testMethodName}", lambda t=test: _run_unittest(t)))
    return cases


def _call_test(fn: Any) -> tuple[str, str | None]:
    try:
        outcome = fn()
        if type(outcome).__name__ == "coroutine":  # `async def test_*`: calling it alone would pass vacuously
            import asyncio

            asyncio.run(outcome)
    except AssertionError as exc:
        return "failed", _format_exception(exc)
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt in a test fail that test
        return "error", _format_exception(exc)
    return "passed", None


def _run_unittest(test: Any) -> tuple[str, str | None]:
    import unittest

    outcome = unittest.TestResult()
    test.run(outcome)
    for label, found in (("failed", outcome.failures), ("error", outcome.errors)):
        if found:
            return label, found[0][1][-_ERROR_CHARS:]
    return ("skipped", None) if outcome.skipped else ("passed", None)
