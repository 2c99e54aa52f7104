"""The same checkpoint scored in-process (`local:DIR`) and behind the OpenAI-compatible server through the official
`openai` client (`openai:URL#MODEL`) gives the same answers and scores, greedy and seeded-sampled."""

from __future__ import annotations

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from openk2.eval.base import EvalContext  # noqa: E402
from openk2.eval.harness import read_records, run_eval  # noqa: E402
from openk2.llm import load_chat_model  # noqa: E402
from tests.infer import test_server as _srv  # noqa: E402

checkpoint, real_server = _srv.checkpoint, _srv.real_server

BENCHMARKS = ["rl:arithmetic"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_local_and_served_agree(tmp_path, checkpoint, real_server, temperature):
    ctx = EvalContext(seed=3, temperature=temperature, max_tokens=24)
    local = load_chat_model(f"local:{checkpoint}", max_seq_len=256, device="cpu", dtype="float32")
    served = load_chat_model(f"openai:{real_server.base}/v1#{_srv.MODEL}", timeout=60, max_retries=1)
    try:
        a = run_eval(local, BENCHMARKS, tmp_path / "local", limit=6, ctx=ctx, progress=False)
        b = run_eval(served, BENCHMARKS, tmp_path / "served", limit=6, ctx=ctx, concurrency=3, progress=False)
    finally:
        served.close()
    for name in BENCHMARKS:
        assert a[name] == b[name]
        ra = {r["id"]: r for r in read_records(tmp_path / "local" / name / "samples.jsonl")}
        rb = {r["id"]: r for r in read_records(tmp_path / "served" / name / "samples.jsonl")}
        assert ra.keys() == rb.keys() and len(ra) == 6
        for key in ra:
            assert (ra[key]["answer"], ra[key]["score"], ra[key]["seed"]) == \
                (rb[key]["answer"], rb[key]["score"], rb[key]["seed"])
        if temperature > 0:  # a random model's greedy text barely depends on the prompt; sampled text does
            assert len({r["answer"] for r in ra.values()}) > 1
