"""End to end with the real default LLM (SmolLM2-135M via `hf:smollm2`) and the real MiniLM embedder."""

from __future__ import annotations

import asyncio
import json

import pytest

from openk2.rephrase.prompts import STYLES, select_styles
from openk2.rephrase.rephraser import CorpusJob, RephraseConfig, Rephraser, find_inputs, rephrase_corpus

DOC = ("The Velmont harbour was dredged in 1821 so that larger ships could moor there.\n\n"
       "Its granite lighthouse burned oil until 1903, when electric lamps replaced the oil.")


@pytest.mark.slow
def test_smollm2_rephrases_and_minilm_checks_a_short_document(tmp_path):
    from openk2.data.embed import default_embedder
    from openk2.llm.registry import load_chat_model

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "doc.jsonl").write_text(json.dumps({"id": "velmont", "text": DOC}) + "\n")
    llm = load_chat_model("hf:smollm2")
    # two segments, so the second request carries the first rewrite as context
    cfg = RephraseConfig(segment_chars=90, max_tokens=60, min_similarity=0.3, temperature=0.0)
    job = CorpusJob(inputs=find_inputs([tmp_path / "in"]), output=tmp_path / "out",
                    styles=select_styles(["encyclopedic"], STYLES))
    summary = asyncio.run(rephrase_corpus(job, Rephraser(llm, default_embedder(), cfg)))
    llm.close()
    session = summary["session"]
    assert session["finished"] == 1 and session["completion_tokens"] > 0
    out = (tmp_path / "out" / "doc.jsonl").read_text().splitlines()
    rejects = (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()
    assert len(out) + len(rejects) == 1  # one verdict, recorded once
    record = json.loads((out or rejects)[0])
    assert record["source_id"] == "velmont" and record["style"] == "encyclopedic"
    if out:  # accepted: a two-part text whose weakest segment passed the MiniLM threshold
        assert record["segments"] == 2 and record["text"].strip() and record["similarity"] >= 0.3
    else:  # rejected: with a reason that names the failed check
        assert record["reason"].split()[0] in ("similarity", "segment", "empty")
