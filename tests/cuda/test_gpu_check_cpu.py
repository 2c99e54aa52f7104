"""The GPU check's CPU dry run (benchmarks/gpu_check.py --device cpu --quick) end to end, so the script cannot
rot without a GPU: every part reports a status in both outputs, and planted failures (an exception, a hang that
only a kill ends, a crash) are reported while the other parts still run. Also: the correctness checks do catch a
bug."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
if str(SCRIPT.parent) not in sys.path:
    sys.path.insert(0, str(SCRIPT.parent))

from gpu_parts.correctness import check_offload, check_qk_clip  # noqa: E402
from gpu_parts.registry import PARTS  # noqa: E402

CPU = torch.device("cpu")
CHECK_PARTS = ("hf_logits", "muon_vs_torch", "qk_clip", "fp8_activations", "offload", "engine_decode")


def _run(out: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--threads", "1", *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_cpu_dry_run_reports_every_part_and_survives_planted_failures(tmp_path):
    # hf_logits hangs deaf to its alarm (the parent must kill the worker and start a fresh one for the parts
    # after it); offload raises (recorded, the same worker goes on); engine_decode kills its worker outright.
    done = _run(tmp_path, "--device", "cpu", "--quick", "--inject-failure", "hf_logits:hang",
                "--time-limit", "hf_logits=2", "--inject-failure", "offload:raise",
                "--inject-failure", "engine_decode:crash")
    assert done.returncode == 1, done.stdout + done.stderr  # planted failures make the run fail
    run = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {p["name"]: p["status"] for p in run["parts"]}
    assert list(status) == [p.name for p in PARTS]  # every part, in order, each exactly once
    assert status["hf_logits"] == "timeout" and status["offload"] == status["engine_decode"] == "error"
    reasons = {p["name"]: p["reason"] for p in run["parts"]}
    assert "killed" in reasons["hf_logits"] and "injected failure" in reasons["offload"]
    assert reasons["engine_decode"] == "worker process died (exit code 70)"
    for name in set(CHECK_PARTS) - {"hf_logits", "offload", "engine_decode"}:
        assert status[name] == "passed", (name, reasons[name])
    for name in ("env", "train_step", "muon_step", "probe", "decode"):
        assert status[name] == "measured", (name, reasons[name])
    assert status["cuda_tests"] == "skipped" and "needs a CUDA GPU" in reasons["cuda_tests"]
    train = next(p for p in run["parts"] if p["name"] == "train_step")
    assert {r["model"] for r in train["tables"]["train step"]} == {"ours", "hf"}
    assert all(r["tok/s"] > 0 for r in train["tables"]["train step"])
    assert "scaled_dot_product" in train["tables"]["train step"][0]["attention ops"]
    decode = next(p for p in run["parts"] if p["name"] == "decode")
    assert len(decode["tables"]["decode (wall clock, medians)"]) == 4  # 2 batches x 2 prompts (--quick)
    md = (tmp_path / "gpu_check.md").read_text()
    for p in run["parts"]:
        assert f"| {p['name']} | {p['status']} |" in md
    assert "[gpu-check] hf_logits: timeout" in done.stdout  # progress lines as it goes


def test_cuda_requested_without_cuda_skips_every_part_with_the_reason(tmp_path):
    done = _run(tmp_path, "--device", "cuda", "--parts", "env,qk_clip", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    run = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(p["name"], p["status"]) for p in run["parts"]] == [("env", "skipped"), ("qk_clip", "skipped")]
    assert all("CUDA is not available" in p["reason"] for p in run["parts"])


def test_bad_arguments_are_one_line_errors(tmp_path):
    done = _run(tmp_path, "--parts", "env,nope", timeout=60)
    assert done.returncode == 2 and "unknown part(s) ['nope']" in done.stderr
    done = _run(tmp_path, "--inject-failure", "env:explode", timeout=60)
    assert done.returncode == 2 and "--inject-failure mode" in done.stderr


def test_offload_check_catches_a_lossy_offloader(monkeypatch):
    from openk2.train.memory import ActivationOffloader

    unpack = ActivationOffloader.unpack

    def lossy(packed):
        out = unpack(packed)
        return out * 0.999 if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    check_offload(CPU)  # passes as it is
    monkeypatch.setattr(ActivationOffloader, "unpack", staticmethod(lossy))
    with pytest.raises(AssertionError, match="offload changed the step"):
        check_offload(CPU)


def test_qk_clip_check_catches_a_wrong_split_of_gamma(monkeypatch):
    from openk2.optim import qk_clip

    scale = qk_clip._scale_rows
    monkeypatch.setattr(qk_clip, "_scale_rows", lambda w, s: scale(w, s * s))  # gamma^2 where sqrt(gamma) is due
    with pytest.raises(AssertionError):
        check_qk_clip(CPU)
