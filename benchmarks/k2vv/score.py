"""Scoring for the conformance benchmark: each answer checked against its request, then the set summarised
(finish reasons, tool-call trigger agreement with a reference run, schema accuracy, HTTP error counts, latency).

A record (one replayed request) is a dict: id, kind, stream, status (HTTP code, or 0 when no response came),
error, latency_s, ttft_s, finish_reason, content, tool_calls [{id, name, arguments}], protocol (a list of
streaming-protocol faults seen). `check` adds the verdicts; `summarize` folds the checked records together.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import jsonschema

FORCED = ("required", "named")


def _schema_error(schema: dict, value: Any) -> str | None:
    try:
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError as err:
        return f"{err.message} at {list(err.absolute_path)}"[:200]
    return None


def check_call(call: dict, tools: list[dict]) -> str | None:
    """Why one returned call is not a well-formed call of a declared tool (None when it is)."""
    declared = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if call.get("name") not in declared:
        return f"undeclared tool {call.get('name')!r}"
    if not call.get("id"):
        return "no call id"
    try:
        args = json.loads(call.get("arguments") or "")
    except (json.JSONDecodeError, TypeError):
        return "arguments are not JSON"
    return _schema_error(declared[call["name"]], args)


def check(record: dict, item: dict) -> dict:
    """The record with verdicts: triggered, call_errors (one per call, None = valid), schema_ok, truncated
    (the reply used all of max_tokens), and for the
    request's kind: forced_ok (required/named), none_ok (none), json_ok (json_schema), consistent (finish_reason
    tool_calls exactly when calls came back)."""
    body, out = item["body"], dict(record)
    calls = record.get("tool_calls") or []
    answered = record["status"] == 200 and not record.get("error")
    out["answered"] = answered
    out["triggered"] = bool(calls) if answered else None
    used, cap = record.get("completion_tokens"), record.get("max_tokens")
    out["truncated"] = bool(answered and used is not None and cap is not None and used >= cap)
    out["call_errors"] = [check_call(c, body.get("tools") or []) for c in calls]
    out["schema_ok"] = all(e is None for e in out["call_errors"]) if calls else None
    out["consistent"] = (record.get("finish_reason") == "tool_calls") == bool(calls) if answered else None
    if answered and item["kind"] in FORCED:
        want = body["tool_choice"]["function"]["name"] if item["kind"] == "named" else None
        out["forced_ok"] = bool(calls) and bool(out["schema_ok"]) and (want is None or all(
            c["name"] == want for c in calls))
    if answered and item["kind"] == "none":
        out["none_ok"] = not calls
    if answered and item["kind"] == "json_schema":
        schema = body["response_format"]["json_schema"].get("schema") or {"type": "object"}
        try:
            out["json_error"] = _schema_error(schema, json.loads(record.get("content") or ""))
        except json.JSONDecodeError:
            out["json_error"] = "content is not JSON"
        out["json_ok"] = out["json_error"] is None
    return out


def _rate(hits: int, total: int) -> float | None:
    return hits / total if total else None


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def trigger_agreement(records: list[dict], reference: list[dict]) -> dict:
    """K2VV's trigger metrics with the reference as truth: TP/FP/FN/TN, precision, recall, F1, agreement, over
    the requests both runs answered."""
    ref = {r["id"]: r["triggered"] for r in reference if r.get("triggered") is not None}
    pairs = [(r["triggered"], ref[r["id"]]) for r in records if r.get("triggered") is not None and r["id"] in ref]
    tp = sum(a and b for a, b in pairs)
    fp = sum(a and not b for a, b in pairs)
    fn = sum(b and not a for a, b in pairs)
    tn = len(pairs) - tp - fp - fn
    precision, recall = _rate(tp, tp + fp), _rate(tp, tp + fn)
    f1 = 2 * precision * recall / (precision + recall) if precision and recall else (
        None if precision is None or recall is None else 0.0)
    return {"compared": len(pairs), "tp": tp, "fp": fp, "fn": fn, "tn": tn, "precision": precision,
            "recall": recall, "f1": f1, "agreement": _rate(tp + tn, len(pairs))}


def summarize(records: list[dict], reference: list[dict] | None = None) -> dict:
    """The run's numbers from checked records (and a reference run's checked records, if given)."""
    answered = [r for r in records if r["answered"]]
    calls = [e for r in answered for e in r["call_errors"]]
    with_calls = [r for r in answered if r["schema_ok"] is not None]
    forced = [r for r in answered if "forced_ok" in r]
    forced_calls = [e for r in forced for e in r["call_errors"]]
    whole = [e for r in answered if not r["truncated"] for e in r["call_errors"]]
    forced_whole = [e for r in forced if not r["truncated"] for e in r["call_errors"]]
    status = Counter(r["status"] for r in records)
    lat = [r["latency_s"] for r in answered]
    ttft = [r["ttft_s"] for r in answered if r.get("ttft_s") is not None]
    out = {
        "requests": len(records), "answered": len(answered),
        "http_2xx": sum(v for k, v in status.items() if 200 <= k < 300),
        "http_4xx": sum(v for k, v in status.items() if 400 <= k < 500),
        "http_5xx": sum(v for k, v in status.items() if k >= 500),
        "no_response": status.get(0, 0),
        "finish_reasons": dict(Counter(str(r.get("finish_reason")) for r in answered)),
        "triggered": sum(bool(r["triggered"]) for r in answered),
        "tool_calls": len(calls), "valid_tool_calls": sum(e is None for e in calls),
        "schema_accuracy_calls": _rate(sum(e is None for e in calls), len(calls)),
        "schema_accuracy_requests": _rate(sum(bool(r["schema_ok"]) for r in with_calls), len(with_calls)),
        "truncated_at_max_tokens": sum(r["truncated"] for r in answered),
        "schema_accuracy_calls_untruncated": _rate(sum(e is None for e in whole), len(whole)),
        "forced_requests": len(forced), "forced_ok": sum(r["forced_ok"] for r in forced),
        "forced_schema_accuracy_calls": _rate(sum(e is None for e in forced_calls), len(forced_calls)),
        "forced_schema_accuracy_calls_untruncated": _rate(sum(e is None for e in forced_whole),
                                                          len(forced_whole)),
        "none_ok": _rate(sum(r["none_ok"] for r in answered if "none_ok" in r),
                         sum("none_ok" in r for r in answered)),
        "json_ok": _rate(sum(r["json_ok"] for r in answered if "json_ok" in r),
                         sum("json_ok" in r for r in answered)),
        "finish_reason_consistent": _rate(sum(bool(r["consistent"]) for r in answered), len(answered)),
        "stream_protocol_faults": sum(len(r.get("protocol") or []) for r in records),
        "prompt_tokens_max": max((r["prompt_tokens"] for r in answered if r.get("prompt_tokens")), default=None),
        "latency_p50_s": _pct(lat, 0.5), "latency_p95_s": _pct(lat, 0.95),
        "stream_ttft_p50_s": _pct(ttft, 0.5),
    }
    if reference is not None:
        out["trigger_vs_reference"] = trigger_agreement(records, reference)
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return "-" if v is None else str(v)


def markdown(summary: dict, records: list[dict], title: str) -> str:
    """A markdown report: the summary table, then one row per request."""
    lines = [f"# {title}", "", "| metric | value |", "|---|---|"]
    for k, v in summary.items():
        if isinstance(v, dict):
            v = ", ".join(f"{a}={_fmt(b)}" for a, b in v.items())
        lines.append(f"| {k} | {_fmt(v)} |")
    lines += ["", "| id | status | finish | tokens | calls | schema | latency s | note |",
              "|---|---|---|---|---|---|---|---|"]
    for r in records:
        names = ",".join(c.get("name") or "?" for c in r.get("tool_calls") or [])
        errs = [e for e in r.get("call_errors") or [] if e] + ([r["json_error"]] if r.get("json_error") else [])
        note = (r.get("error") or "; ".join(errs + (r.get("protocol") or [])))[:120].replace("|", "/")
        lines.append(f"| {r['id']} | {r['status']} | {r.get('finish_reason') or '-'} | "
                     f"{_fmt(r.get('completion_tokens'))}/{_fmt(r.get('max_tokens'))} | {names or '-'} | "
                     f"{_fmt(r.get('schema_ok'))} | {_fmt(r.get('latency_s'))} | {note} |")
    return "\n".join(lines) + "\n"
