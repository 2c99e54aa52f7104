"""The rephrasing pipeline with a deterministic fake ChatModel and the real MiniLM embedder.

Covers chunk-wise autoregressive prompting, stitching, fidelity rejection, the LLM judge, bad records, resume after
cancellation, after a torn journal line, and after SIGKILL of a real subprocess.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from openk2.cli.rephrase import rephrase_main
from openk2.llm.base import ChatModel, ChatResponse
from openk2.rephrase.prompts import STYLES, load_styles, parse_verdict, select_styles
from openk2.rephrase.rephraser import (
    REJECTS_FILE,
    CorpusJob,
    RephraseConfig,
    Rephraser,
    find_inputs,
    rephrase_corpus,
    rephrase_text,
)

PASSAGE = re.compile(r"<passage>\n(.*)\n</passage>", re.DOTALL)


class FakeRewriter(ChatModel):
    """Deterministic: rewrites a passage as 'In other words, <passage>'; a passage containing GARBLE comes back as
    unrelated text; judge prompts get FAITHFUL unless the original contains LIAR."""

    name = "fake"

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[list[dict]] = []
        self.delay = delay

    def chat(self, messages, tools=None, **sampling):
        self.calls.append(messages)
        user = messages[-1]["content"]
        if "<original>" in user:
            return [ChatResponse("UNFAITHFUL" if "LIAR" in user else "FAITHFUL", finish_reason="stop")]
        passage = PASSAGE.search(user).group(1)
        if "GARBLE" in passage:
            reply = "Bananas are yellow and monkeys enjoy eating them in tropical forests."
        else:
            reply = "Here is the rewritten text:\nIn other words, " + passage
        return [ChatResponse(reply, finish_reason="stop", usage={"completion_tokens": len(reply.split())})]

    async def achat(self, messages, tools=None, **sampling):
        if self.delay:
            await asyncio.sleep(self.delay)
        return self.chat(messages, tools, **sampling)


@pytest.fixture(scope="module")
def embedder():
    from openk2.data.embed import default_embedder

    return default_embedder()


DOC = ("The harbour of Velmont was dredged in 1821. Ships from three continents moored there.\n\n"
       "Its lighthouse, built of granite, was lit by oil until 1903. Then electric lamps replaced the oil.\n\n"
       "Today the harbour serves ferries and fishing boats.")


def test_long_document_is_rewritten_chunk_by_chunk_with_the_rewrite_so_far_as_context(embedder):
    llm = FakeRewriter()
    cfg = RephraseConfig(segment_chars=100, context_chars=40)
    result = rephrase_text(llm, DOC, "textbook", embedder, cfg)
    assert result.accepted, result.reason
    assert result.segments == len(llm.calls) == 3
    # each later request carries the tail of the earlier rewrites, the first none
    assert "<previous>" not in llm.calls[0][-1]["content"]
    for i in (1, 2):
        prompt = llm.calls[i][-1]["content"]
        assert f"part {i + 1} of 3" in prompt and "<previous>" in prompt
        assert re.search(r"<previous>\n(.*)\n</previous>", prompt, re.DOTALL).group(1) in result.text
    assert STYLES["textbook"].instruction in llm.calls[0][-1]["content"]
    # stitched in order, paragraph breaks kept, the chatty preamble removed
    assert result.text.count("In other words, ") == 3 and "Here is" not in result.text
    assert result.text.split("\n\n")[1].startswith("In other words, Its lighthouse")
    assert result.similarity > 0.7


def test_unfaithful_segment_rejects_the_whole_rewrite(embedder):
    doc = DOC.replace("Today the harbour", "GARBLE today the harbour")
    result = rephrase_text(FakeRewriter(), doc, "qa", embedder, RephraseConfig(segment_chars=100))
    assert not result.accepted and result.text is not None
    assert result.reason.startswith("similarity") and "(segment 2)" in result.reason
    assert result.similarity < 0.7


def test_llm_judge_rejects_added_or_lost_facts():
    cfg = RephraseConfig(segment_chars=100, judge=True)
    assert rephrase_text(FakeRewriter(), DOC, "news", None, cfg).accepted
    bad = rephrase_text(FakeRewriter(), DOC.replace("ferries", "LIAR ferries"), "news", None, cfg)
    assert bad.reason == "judge: segment 2 adds or loses facts"
    assert [parse_verdict(r) for r in ("FAITHFUL.", "unfaithful", "maybe")] == [True, False, None]


def test_style_file_extends_the_bank(tmp_path):
    (tmp_path / "s.toml").write_text('[pirate]\ninstruction = "Rewrite it as a pirate would say it."\n')
    bank = load_styles(tmp_path / "s.toml")
    assert bank["pirate"].mode == "rephrase" and "encyclopedic" in bank
    (tmp_path / "bad.json").write_text(json.dumps({"x": {"instruction": "y", "colour": 1}}))
    with pytest.raises(ValueError, match="unknown keys"):
        load_styles(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="unknown style"):
        select_styles(["nope"], bank)
    assert not STYLES["translate-en"].check_similarity and STYLES["math-note"].mode == "math-note"


def _write_corpus(path: Path, n: int, extra: list[str] = ()) -> None:
    lines = [json.dumps({"id": f"d{i}", "text": f"Document {i} says that the river Oslan is {i} km long. "
                                                f"Fishermen there catch {i} kinds of trout."}) for i in range(n)]
    path.write_text("\n".join([*lines, *extra]) + "\n")


def _job(tmp_path: Path, copies: int = 2, **kw) -> CorpusJob:
    return CorpusJob(inputs=find_inputs([tmp_path / "in"]), output=tmp_path / "out",
                     styles=select_styles(["encyclopedic", "qa", "child"], STYLES), copies=copies, **kw)


def _outputs(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(out.glob("*.jsonl")) if f.name != REJECTS_FILE
            for line in f.read_text().splitlines()]


def test_corpus_run_writes_outputs_rejects_and_stats(tmp_path, embedder):
    (tmp_path / "in").mkdir()
    bad = ["{not json", json.dumps({"id": "x", "body": "no text field"}), json.dumps({"id": "d1", "text": "dup"}),
           json.dumps({"id": "g", "text": "GARBLE the river Oslan floods every spring."})]
    _write_corpus(tmp_path / "in" / "a.jsonl", 4, bad)
    summary = asyncio.run(rephrase_corpus(_job(tmp_path), Rephraser(FakeRewriter(), embedder)))
    outs = _outputs(tmp_path / "out")
    assert sorted((o["source_id"], o["copy"]) for o in outs) == [(f"d{i}", c) for i in range(4) for c in range(2)]
    assert len({o["style"] for o in outs if o["source_id"] == "d0"}) == 2  # copies take different styles
    rejects = [json.loads(line) for line in (tmp_path / "out" / REJECTS_FILE).read_text().splitlines()]
    reasons = sorted(r["reason"] for r in rejects if r["copy"] == -1)
    assert [r.split(":")[1].split()[0] for r in reasons] == ["duplicate", "invalid", "no"]
    assert reasons[2] == "bad record: no string field 'text'"
    assert all(r["reason"].startswith("bad record") == (r["copy"] == -1) for r in rejects)
    assert sum(r["reason"].startswith("similarity") for r in rejects) == 2  # both copies of the GARBLE document
    assert summary["accepted"] == 8 and summary["rejected"] == {"similarity": 2} and summary["bad_records"] == 3
    assert summary["acceptance_rate"] == 0.8
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["accepted"] == 8


def test_rerun_does_nothing_twice_and_finishes_a_limited_run(tmp_path):
    (tmp_path / "in").mkdir()
    _write_corpus(tmp_path / "in" / "a.jsonl", 6)
    llm = FakeRewriter()
    asyncio.run(rephrase_corpus(_job(tmp_path, limit=2), Rephraser(llm, None)))
    assert len(llm.calls) == 4 and len(_outputs(tmp_path / "out")) == 4
    asyncio.run(rephrase_corpus(_job(tmp_path), Rephraser(llm, None)))
    assert len(llm.calls) == 12  # only the 8 missing units were asked for
    summary = asyncio.run(rephrase_corpus(_job(tmp_path), Rephraser(llm, None)))
    assert len(llm.calls) == 12 and summary["session"]["skipped_already_done"] == 12
    keys = [(o["source_id"], o["copy"]) for o in _outputs(tmp_path / "out")]
    assert len(keys) == len(set(keys)) == 12


def test_cancelled_run_resumes_without_loss_or_duplicates(tmp_path):
    (tmp_path / "in").mkdir()
    _write_corpus(tmp_path / "in" / "a.jsonl", 30)

    async def interrupted():
        job = _job(tmp_path, concurrency=3)
        await asyncio.wait_for(rephrase_corpus(job, Rephraser(FakeRewriter(delay=0.01), None, max_concurrency=3)),
                               timeout=0.15)

    with pytest.raises(TimeoutError):
        asyncio.run(interrupted())
    partial = len(_outputs(tmp_path / "out"))
    assert 0 < partial < 60
    llm = FakeRewriter()
    asyncio.run(rephrase_corpus(_job(tmp_path), Rephraser(llm, None)))
    keys = [(o["source_id"], o["copy"]) for o in _outputs(tmp_path / "out")]
    assert len(keys) == len(set(keys)) == 60 and len(llm.calls) == 60 - partial


def test_torn_last_line_is_repaired_and_redone(tmp_path):
    (tmp_path / "in").mkdir()
    _write_corpus(tmp_path / "in" / "a.jsonl", 3)
    asyncio.run(rephrase_corpus(_job(tmp_path), Rephraser(FakeRewriter(), None)))
    shard = tmp_path / "out" / "a.jsonl"
    lines = shard.read_text().splitlines(keepends=True)
    shard.write_text("".join(lines[:-1]) + lines[-1][:25])  # killed in the middle of the last write
    llm = FakeRewriter()
    asyncio.run(rephrase_corpus(_job(tmp_path), Rephraser(llm, None)))
    assert len(llm.calls) == 1
    assert [json.loads(x)["id"] for x in shard.read_text().splitlines()] == [json.loads(x)["id"] for x in lines]


KILL_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_rephraser import FakeRewriter, _job
    from openk2.rephrase.rephraser import Rephraser, rephrase_corpus
    asyncio.run(rephrase_corpus(_job(Path({tmp!r}), concurrency=2), Rephraser(FakeRewriter(0.02), None)))
""")


def test_sigkilled_process_resumes_exactly(tmp_path):
    (tmp_path / "in").mkdir()
    _write_corpus(tmp_path / "in" / "a.jsonl", 200)
    script = tmp_path / "run.py"
    script.write_text(KILL_SCRIPT.format(tests=str(Path(__file__).parent), tmp=str(tmp_path)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shard = tmp_path / "out" / "a.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and (not shard.exists() or shard.read_text().count("\n") < 10):
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = len(_outputs(tmp_path / "out"))
    assert 10 <= partial < 400, "the run finished before it could be killed"
    llm = FakeRewriter()
    asyncio.run(rephrase_corpus(_job(tmp_path), Rephraser(llm, None)))
    keys = [(o["source_id"], o["copy"]) for o in _outputs(tmp_path / "out")]
    assert len(keys) == len(set(keys)) == 400 and len(llm.calls) == 400 - partial


def test_cli_reports_bad_input_as_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        rephrase_main(["--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o")])
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="must be .jsonl or .parquet"):
        rephrase_main(["--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "o")])
    (tmp_path / "a.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="unknown style"):
        rephrase_main(["--input", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o"), "--styles", "nope"])
