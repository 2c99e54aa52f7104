"""A model endpoint that is down is not a reject: `openk2 rephrase` against a real HTTP endpoint that is closed,
returns 5xx or goes down mid-run stops with one clear line, records nothing for the units in hand, and the rerun
(endpoint back up) finishes exactly the missing work, once."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from openk2.cli.rephrase import rephrase_main
from openk2.llm.base import ChatModel, ChatResponse
from openk2.llm.openai_backend import OpenAIChatModel
from openk2.llm.transport import EndpointUnreachable
from openk2.rephrase.prompts import STYLES, select_styles
from openk2.rephrase.rephraser import REJECTS_FILE, CorpusJob, Rephraser, find_inputs, rephrase_corpus
from tests.llm.fake_endpoint import FakeEndpoint, free_port

PASSAGE = re.compile(r"<passage>\n(.*)\n</passage>", re.DOTALL)


class Echo(ChatModel):
    """Rewrites a passage as 'In other words, <passage>'; `on_call(n)` runs before the n-th reply (1-based)."""

    name = "echo"

    def __init__(self, on_call=None) -> None:
        self.calls = 0
        self.on_call = on_call

    def chat(self, messages, tools=None, **sampling):
        self.calls += 1
        if self.on_call is not None:
            self.on_call(self.calls)
        passage = PASSAGE.search(messages[-1]["content"]).group(1)
        return [ChatResponse("In other words, " + passage, finish_reason="stop", usage={"completion_tokens": 3})]


def _corpus(tmp_path: Path, n: int = 5) -> Path:
    (tmp_path / "in").mkdir()
    lines = [json.dumps({"id": f"d{i}", "text": f"The river Oslan is {i} km long."}) for i in range(n)]
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "in"


def _job(tmp_path: Path, concurrency: int = 4) -> CorpusJob:
    return CorpusJob(inputs=find_inputs([tmp_path / "in"]), output=tmp_path / "out",
                     styles=select_styles(["encyclopedic", "qa"], STYLES), copies=2, concurrency=concurrency)


def _run(tmp_path: Path, port: int, max_retries: int = 1, concurrency: int = 4) -> dict:
    llm = OpenAIChatModel(f"http://127.0.0.1:{port}/v1", model="fake", max_retries=max_retries, timeout=5)
    try:
        return asyncio.run(rephrase_corpus(_job(tmp_path, concurrency), Rephraser(llm, None,
                                                                                  max_concurrency=concurrency)))
    finally:
        llm.close()


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_endpoint_down_then_up_finishes_the_work_once(tmp_path):
    _corpus(tmp_path)
    port = free_port()
    with pytest.raises(EndpointUnreachable, match=r"APIConnectionError.*rerun the same command"):
        _run(tmp_path, port)
    assert _lines(tmp_path / "out" / "a.jsonl") == [] and _lines(tmp_path / "out" / REJECTS_FILE) == []
    endpoint = FakeEndpoint(Echo())
    endpoint.start(port)
    try:
        summary = _run(tmp_path, port)
        assert summary["accepted"] == 10 and summary["rejected"] == {}
        assert endpoint.requests == 10
        again = _run(tmp_path, port)  # nothing left: no request at all
        assert endpoint.requests == 10 and again["session"]["skipped_already_done"] == 10
    finally:
        endpoint.stop()
    keys = [(o["source_id"], o["copy"]) for o in _lines(tmp_path / "out" / "a.jsonl")]
    assert len(keys) == len(set(keys)) == 10 and _lines(tmp_path / "out" / REJECTS_FILE) == []


def test_endpoint_failing_mid_run_with_5xx_keeps_finished_units_and_redoes_the_rest(tmp_path):
    _corpus(tmp_path, n=6)
    endpoint = FakeEndpoint(None)
    endpoint.model = Echo(on_call=lambda n: endpoint.fail_next(10_000) if n == 4 else None)  # 503s after 4 replies
    port = free_port()
    endpoint.start(port)
    try:
        with pytest.raises(EndpointUnreachable, match=r"InternalServerError.*4 unit\(s\) finished"):
            _run(tmp_path, port, concurrency=1)
        assert len(_lines(tmp_path / "out" / "a.jsonl")) == 4 and _lines(tmp_path / "out" / REJECTS_FILE) == []
        endpoint._fail.clear()  # the endpoint recovers
        endpoint.model.on_call = None
        summary = _run(tmp_path, port)
    finally:
        endpoint.stop()
    assert summary["accepted"] == 12 and summary["session"]["skipped_already_done"] == 4
    keys = [(o["source_id"], o["copy"]) for o in _lines(tmp_path / "out" / "a.jsonl")]
    assert len(keys) == len(set(keys)) == 12


def test_transient_5xx_is_retried_with_backoff_inside_the_backend(tmp_path):
    _corpus(tmp_path, n=2)
    endpoint = FakeEndpoint(Echo())
    port = free_port()
    endpoint.start(port)
    endpoint.fail_next(2, status=503)
    try:
        summary = _run(tmp_path, port, max_retries=3, concurrency=1)
    finally:
        endpoint.stop()
    assert summary["accepted"] == 4 and summary["rejected"] == {}
    assert endpoint.requests == 4 + 2  # the two 503s were retried, not recorded


def test_cli_stops_with_one_line_and_exit_1_when_the_endpoint_is_down(tmp_path, capsys):
    _corpus(tmp_path, n=2)
    out = tmp_path / "out"
    code = rephrase_main(["--input", str(tmp_path / "in"), "--output", str(out), "--no-similarity",
                          "--llm", f"openai:http://127.0.0.1:{free_port()}/v1#fake"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "Traceback" not in err
    err = err.splitlines()[-1]  # the progress bar (stderr) aside, one line
    assert err.startswith("openk2 rephrase: error: the model could not be reached") and "rerun" in err
    assert _lines(out / REJECTS_FILE) == [] and _lines(out / "a.jsonl") == []
