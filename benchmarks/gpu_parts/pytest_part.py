"""The CUDA-marked tests (`pytest -m cuda tests/cuda`) in a subprocess with the part's time limit, counted from
pytest's JUnit XML. On a machine without CUDA they are all skipped, and so is this part."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from .context import PartContext, PartSkipped


def _counts(junit: Path) -> tuple[dict, list[str], list[str]]:
    """Totals, one line per failing test, and the distinct skip reasons, from a JUnit XML file."""
    root = ET.parse(junit).getroot()
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failing, skips = [], []
    for case in root.iter("testcase"):
        totals["tests"] += 1
        for kind, key in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
            node = case.find(kind)
            if node is None:
                continue
            totals[key] += 1
            message = " ".join((node.get("message") or "").split())[:200]
            if kind == "skipped":
                skips.append(message)
            else:
                failing.append(f"{case.get('name')}: {message}")
    return totals, failing, sorted(set(skips))


def run(ctx: PartContext) -> dict:
    """Run the CUDA tests; passed when none failed, skipped when all were skipped."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "cuda.xml"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ctx.repo / "src"),
                                                                         os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={junit}",
               "tests/cuda"]
        try:
            done = subprocess.run(cmd, cwd=ctx.repo, env=env, capture_output=True, text=True,
                                  timeout=max(ctx.left() - 3, 1))
        except subprocess.TimeoutExpired as err:
            raise TimeoutError(f"pytest ran past {err.timeout:.0f} s") from err
        if not junit.is_file():
            tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
            raise RuntimeError(f"pytest wrote no report (exit {done.returncode}): {tail}")
        totals, failing, skips = _counts(junit)
    metrics = {**totals, "exit_code": done.returncode, "failing": failing}
    if totals["tests"] == 0:
        raise RuntimeError("pytest collected no CUDA-marked tests")
    if totals["skipped"] == totals["tests"]:
        raise PartSkipped(f"all {totals['tests']} CUDA tests skipped: {'; '.join(skips)}")
    ok = not failing and done.returncode == 0
    reason = "" if ok else f"{len(failing)} of {totals['tests']} failed: {failing[0] if failing else done.returncode}"
    return {"status": "passed" if ok else "failed", "reason": reason, "metrics": metrics}
