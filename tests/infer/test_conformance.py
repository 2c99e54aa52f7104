"""The conformance benchmark (benchmarks/bench_conformance.py, K2 Vendor Verifier style) in CI: a subset of
benchmarks/k2vv/requests.jsonl replayed with the official `openai` client against a real `openk2 serve`
subprocess (tiny untrained checkpoint, constrained decoding on: --strict-tool-calls). Forced calls (tool_choice
required / named) that finish must be 100% schema-valid, tool_choice none must call nothing, response_format
must validate, no 5xx, no 4xx, and streamed replies must follow OpenAI's chunk protocol. The scorer itself is
checked on hand-made records. Known server faults found by the benchmark are strict xfails, so a fix shows."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_conformance  # noqa: E402
from k2vv.launch import start_server, stop_server, write_tiny_checkpoint  # noqa: E402
from k2vv.score import check, check_call, summarize, trigger_agreement  # noqa: E402
from k2vv.tools import TOOLS  # noqa: E402

# create_ticket's schema uses uniqueItems, which llguidance does not implement: the server then constrains its
# arguments to any JSON object (see test_unimplemented_keyword_keeps_the_rest_of_the_schema), so it is left
# out of the subset whose forced calls must all validate.
UNCOMPILED = "create_ticket"
PER_KIND = {"required": 6, "named": 8, "auto": 3, "none": 1, "json_schema": 2, "chat": 1}


def _subset() -> list[dict]:
    items = bench_conformance.load_requests(bench_conformance.DEFAULT_REQUESTS)
    out, taken = [], dict.fromkeys(PER_KIND, 0)
    for it in items:
        declared = {t["function"]["name"] for t in it["body"].get("tools") or []}
        if UNCOMPILED in declared or taken[it["kind"]] >= PER_KIND[it["kind"]]:
            continue
        taken[it["kind"]] += 1
        out.append(it)
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-k2vv")
    proc, base = start_server(ckpt, ["--max-seq-len", "6144", "--strict-tool-calls",
                                     "--grammar-max-string-length", "32"])
    yield base + "/v1"
    stop_server(proc)


@pytest.mark.slow
def test_subset_replay_is_conformant(server):
    items = _subset()
    assert sum(it["body"].get("stream", False) for it in items) >= 4
    records = asyncio.run(bench_conformance.replay(server, items, concurrency=4, timeout=120))
    s = summarize(records)
    assert s["http_5xx"] == 0 and s["http_4xx"] == 0 and s["no_response"] == 0, s
    assert s["stream_protocol_faults"] == 0, [r["protocol"] for r in records if r["protocol"]]
    forced = [r for r in records if r["kind"] in ("required", "named")]
    whole = [r for r in forced if not r["truncated"]]
    assert len(whole) >= 10, "too many forced replies ran into max_tokens for the check to mean anything"
    for r in whole:
        assert r["finish_reason"] == "tool_calls" and r["forced_ok"], (r["id"], r["tool_calls"], r["call_errors"])
    assert s["forced_schema_accuracy_calls_untruncated"] == 1.0
    assert s["none_ok"] == 1.0 and s["json_ok"] == 1.0, s
    assert s["finish_reason_consistent"] == 1.0
    assert s["schema_accuracy_calls_untruncated"] == 1.0  # strict auto calls too


def _client(base: str):
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)


def test_call_cut_by_max_tokens_reports_length(server):
    client = _client(server)
    tools = [TOOLS["get_weather"]]
    r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=3, tools=tools,
                                       messages=[{"role": "user", "content": "Weather in Lima?"}],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"


def test_unimplemented_keyword_keeps_the_rest_of_the_schema(server):
    client = _client(server)
    tool = TOOLS[UNCOMPILED]
    r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=400, tools=[tool],
                                       n=3, temperature=1.0, seed=7,
                                       messages=[{"role": "user", "content": "File a bug."}],
                                       tool_choice={"type": "function", "function": {"name": UNCOMPILED}})
    relaxed = json.loads(json.dumps(tool["function"]["parameters"]))
    relaxed["properties"]["labels"].pop("uniqueItems")  # what the grammar could have held
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), relaxed)


# ------------------------------------------------------------------------------------ the scorer, offline
def test_request_file_is_what_the_generator_writes():
    from k2vv.make_requests import EXAMPLE_ARGS, make_requests

    lines = bench_conformance.DEFAULT_REQUESTS.read_text().splitlines()
    assert lines == [json.dumps(r, sort_keys=True) for r in make_requests(0)]
    assert len(lines) >= 100
    for name, args in EXAMPLE_ARGS.items():  # the earlier turns' calls are valid ones
        jsonschema.validate(args, TOOLS[name]["function"]["parameters"])


def _rec(id_: str, kind: str, calls: list[dict], finish: str = "tool_calls", **kw) -> dict:
    base = {"id": id_, "kind": kind, "stream": False, "status": 200, "error": None, "latency_s": 0.1,
            "ttft_s": None, "finish_reason": finish, "content": kw.pop("content", None), "tool_calls": calls,
            "protocol": [], "completion_tokens": 10, "max_tokens": 100}
    return {**base, **kw}


def test_check_call_rejects_what_does_not_validate():
    tools = [TOOLS["get_weather"]]
    ok = {"id": "c1", "name": "get_weather", "arguments": '{"city": "Lima", "days": 2}'}
    assert check_call(ok, tools) is None
    assert "undeclared" in check_call({**ok, "name": "get_time"}, tools)
    assert check_call({**ok, "arguments": '{"city": "Lima"'}, tools) == "arguments are not JSON"
    assert "is not one of" in check_call({**ok, "arguments": '{"city": "Rome"}'}, tools)
    assert check_call({**ok, "arguments": '{"city": "Lima", "days": 9}'}, tools) is not None
    assert check_call({**ok, "arguments": '{"city": "Lima", "extra": 1}'}, tools) is not None
    assert check_call({**ok, "id": ""}, tools) == "no call id"


def test_check_and_summary_count_what_happened():
    tools = [TOOLS["get_weather"]]
    good = {"id": "c", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    bad = {"id": "c", "name": "get_weather", "arguments": '{"days": 3}'}
    named = {"type": "function", "function": {"name": "get_weather"}}
    items = {"a": {"kind": "named", "body": {"tools": tools, "tool_choice": named}},
             "b": {"kind": "required", "body": {"tools": tools, "tool_choice": "required"}},
             "c": {"kind": "none", "body": {"tools": tools, "tool_choice": "none"}},
             "d": {"kind": "auto", "body": {"tools": tools}}}
    recs = [check(_rec("a", "named", [good]), {"id": "a", **items["a"]}),
            check(_rec("b", "required", [bad], completion_tokens=100), {"id": "b", **items["b"]}),
            check(_rec("c", "none", [], finish="stop"), {"id": "c", **items["c"]}),
            check(_rec("d", "auto", [good], finish="stop", status=500), {"id": "d", **items["d"]})]
    s = summarize(recs)
    assert (s["answered"], s["http_5xx"], s["tool_calls"], s["valid_tool_calls"]) == (3, 1, 2, 1)
    assert (s["forced_requests"], s["forced_ok"], s["truncated_at_max_tokens"]) == (2, 1, 1)
    assert s["forced_schema_accuracy_calls"] == 0.5 and s["forced_schema_accuracy_calls_untruncated"] == 1.0
    assert s["none_ok"] == 1.0 and s["finish_reason_consistent"] == 1.0
    inconsistent = check(_rec("e", "auto", [good], finish="stop"), {"id": "e", **items["d"]})
    assert inconsistent["consistent"] is False


def test_trigger_agreement_against_a_reference():
    def t(id_, v):
        return {"id": id_, "triggered": v}
    ref = [t("1", True), t("2", True), t("3", False), t("4", False), t("5", None)]
    run = [t("1", True), t("2", False), t("3", True), t("4", False), t("5", True), t("6", True)]
    a = trigger_agreement(run, ref)
    assert (a["compared"], a["tp"], a["fp"], a["fn"], a["tn"]) == (4, 1, 1, 1, 1)
    assert a["precision"] == 0.5 and a["recall"] == 0.5 and a["f1"] == 0.5 and a["agreement"] == 0.5
