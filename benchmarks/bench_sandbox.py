"""Cost of the code sandbox: start latency of one run (p50/p95) and throughput of HumanEval checks.

    python benchmarks/bench_sandbox.py [--runs 40] [--checks 100] [--concurrency 2]

Latency: `run_python("pass")` (no tests: one sandbox) and a one-test run (tests given: the candidate and the
judge sandboxes), each timed end to end `--runs` times after one warm-up. Throughput: the first `--checks`
HumanEval problems with their canonical solutions, checked through `HumanEvalBenchmark.run_completions` with
`--concurrency` runs at once; reports checks per second and how many passed. Results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_summary  # noqa: E402


def _percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between sorted values."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def latency(runs: int) -> dict[str, tuple[float, float]]:
    """p50 and p95 seconds of a bare run and of a one-test run."""
    from openk2.agentic.sandbox import run_python

    cases = {"no tests": ("pass", None),
             "one test": ("def add(a, b):\n    return a + b\n", "def test_add():\n    assert add(1, 2) == 3\n")}
    out = {}
    for label, (code, tests) in cases.items():
        run_python(code, tests)  # warm-up: probes and caches
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            result = run_python(code, tests)
            times.append(time.perf_counter() - start)
            assert result.killed_reason is None and result.failed == 0, result
        out[label] = (statistics.median(times), _percentile(times, 95))
    return out


def throughput(checks: int, concurrency: int) -> tuple[float, int, int]:
    """Seconds for `checks` canonical HumanEval solutions, checks passed, checks run."""
    from openk2.eval.humaneval import HumanEvalBenchmark, load_problems

    problems = load_problems()[:checks]
    bench = HumanEvalBenchmark(max_concurrency=concurrency)
    texts = [f"```python\n{p['prompt']}{p['canonical_solution']}```" for p in problems]
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda pt: bench.run_completions(pt[0], [pt[1]])[0], zip(problems, texts, strict=True)))
    seconds = time.perf_counter() - start
    bench.close()
    return seconds, sum(r.ok and r.passed > 0 for r in results), len(results)


def main() -> None:
    """Print the latency table and the HumanEval throughput."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--checks", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    print(machine_summary())
    for label, (p50, p95) in latency(args.runs).items():
        print(f"start latency, {label}: p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms ({args.runs} runs)")
    seconds, passed, total = throughput(args.checks, args.concurrency)
    print(f"HumanEval: {total} canonical checks in {seconds:.1f} s ({total / seconds:.2f} checks/s, "
          f"concurrency {args.concurrency}), {passed}/{total} passed")


if __name__ == "__main__":
    main()
