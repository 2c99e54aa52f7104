"""`openk2 synth run` with its model endpoint down: nothing is stored as a result (no empty domains, no
agent_error trajectories), the run stops naming the stage, and the rerun with the endpoint up finishes the work
with nothing duplicated. The endpoint is a real local HTTP server answering with the scripted model, reached
through the official openai client."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from openk2.agentic.pipeline import ROLES, SynthPipeline
from openk2.cli.synth import synth_main
from openk2.llm.openai_backend import OpenAIChatModel
from openk2.llm.transport import EndpointUnreachable
from tests.agentic.fake_models import ScriptedModel
from tests.agentic.test_pipeline import _cfg
from tests.llm.fake_endpoint import FakeEndpoint, free_port


class SlowAfter(ScriptedModel):
    """The scripted model that, from its `after`-th call on, takes `delay` seconds (longer than the client waits)."""

    def __init__(self, after: int, delay: float = 1.5) -> None:
        super().__init__()
        self.after, self.delay = after, delay
        self._lock = threading.Lock()

    def chat(self, messages, tools=None, **sampling):
        with self._lock:
            slow = len(self.calls) + 1 >= self.after
        if slow:
            time.sleep(self.delay)
        return super().chat(messages, tools, **sampling)


def _remote(port: int, timeout: float = 10) -> dict:
    model = OpenAIChatModel(f"http://127.0.0.1:{port}/v1", model="fake", max_retries=1, timeout=timeout)
    return {role: model for role in ROLES}


def _ids(path: Path, key: str) -> list[str]:
    return [json.loads(x)[key] for x in path.read_text().splitlines()] if path.exists() else []


def test_endpoint_down_stores_nothing_and_the_rerun_finishes(tmp_path):
    port = free_port()
    with pytest.raises(EndpointUnreachable, match=r"stage 'domains'.*APIConnectionError.*rerun the same command"):
        SynthPipeline(_cfg(), tmp_path, _remote(port)).run()
    assert _ids(tmp_path / "domains.jsonl", "category") == []  # no empty domain lists saved as done
    endpoint = FakeEndpoint(ScriptedModel())
    endpoint.start(port)
    try:
        stats = SynthPipeline(_cfg(), tmp_path, _remote(port)).run()
        requests = endpoint.requests
        again = SynthPipeline(_cfg(), tmp_path, _remote(port)).run()
    finally:
        endpoint.stop()
    assert stats["tools"]["total"] == 8 and stats["acceptance"]["accepted"] == 6 == stats["acceptance"]["judged"]
    assert endpoint.requests == requests and again["acceptance"] == stats["acceptance"]  # the rerun asked nothing


def test_timeouts_mid_episodes_leave_those_items_pending(tmp_path):
    endpoint = FakeEndpoint(SlowAfter(after=25))  # the tool stages need ~12 calls; episodes start after them
    port = free_port()
    endpoint.start(port)
    try:
        with pytest.raises(EndpointUnreachable, match=r"stage 'episodes'.*APITimeoutError"):
            SynthPipeline(_cfg(), tmp_path, _remote(port, timeout=0.4)).run()
        trajectories = _ids(tmp_path / "trajectories.jsonl", "trajectory_id")
        judged = _ids(tmp_path / "judged.jsonl", "trajectory_id")
        assert len(judged) < 6
        stored = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()] \
            if trajectories else []
        assert not any(t["end_reason"].startswith("agent_error") for t in stored)
        endpoint.model = ScriptedModel()  # the endpoint recovers
        stats = SynthPipeline(_cfg(), tmp_path, _remote(port)).run()
    finally:
        endpoint.stop()
    assert stats["acceptance"]["judged"] == 6 == stats["acceptance"]["accepted"]
    for name in ("trajectories", "judged"):
        ids = _ids(tmp_path / f"{name}.jsonl", "trajectory_id")
        assert len(ids) == len(set(ids)) == 6
    assert set(trajectories) <= set(_ids(tmp_path / "trajectories.jsonl", "trajectory_id"))


def test_cli_stops_with_one_line_and_exit_1(tmp_path, capsys):
    config = tmp_path / "synth.toml"
    spec = f"openai:http://127.0.0.1:{free_port()}/v1#fake"
    roles = "\n".join(f'{role} = "{spec}"' for role in ROLES)
    config.write_text(f'[models]\n{roles}\n[tools]\nmcp_servers = []\nembedding_dedup = false\n'
                      'categories = ["robot control"]\n')
    code = synth_main(["run", "--config", str(config), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "Traceback" not in err
    err = err.splitlines()[-1]  # the progress bar (stderr) aside, one line
    assert err.startswith("openk2 synth: error: an endpoint could not be reached") and "rerun" in err


_CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from openk2.agentic.pipeline import ROLES, SynthPipeline
from tests.agentic.fake_models import ScriptedModel
from tests.agentic.test_pipeline import _cfg

class Slow(ScriptedModel):
    def chat(self, messages, tools=None, **sampling):
        time.sleep(0.05)
        return super().chat(messages, tools, **sampling)

model = Slow()
SynthPipeline(_cfg(), {out!r}, {{role: model for role in ROLES}}).run()
"""


def test_kill_9_mid_run_then_resume_is_exact(tmp_path):
    """A run killed with SIGKILL mid-episodes, resumed: every item once, what was stored kept, nothing lost."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    root = str(Path(__file__).resolve().parents[2])
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(root=root, out=str(out))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(_ids(out / "trajectories.jsonl", "trajectory_id")) < 2 and time.monotonic() < deadline:
            assert child.poll() is None, "the run ended before it could be killed"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    before = {name: (out / name).read_bytes() for name in ("domains.jsonl", "synthetic.jsonl", "agents.jsonl",
                                                           "tasks.jsonl", "trajectories.jsonl")}
    stored = _ids(out / "trajectories.jsonl", "trajectory_id")
    assert 2 <= len(stored) < 6
    model = ScriptedModel()
    stats = SynthPipeline(_cfg(), out, {role: model for role in ROLES}).run()
    for name in ("domains.jsonl", "synthetic.jsonl", "agents.jsonl", "tasks.jsonl"):
        assert (out / name).read_bytes() == before[name]  # finished stages untouched
    after = (out / "trajectories.jsonl").read_bytes()
    complete = before["trajectories.jsonl"][:before["trajectories.jsonl"].rfind(b"\n") + 1]
    assert after.startswith(complete)  # stored trajectories kept byte for byte (a cut-off last line dropped)
    for name in ("trajectories.jsonl", "judged.jsonl"):
        ids = _ids(out / name, "trajectory_id")
        assert len(ids) == len(set(ids)) == 6
    assert stats["acceptance"]["judged"] == 6 == stats["acceptance"]["accepted"]
    assert len((out / "sft.jsonl").read_text().splitlines()) == 6
