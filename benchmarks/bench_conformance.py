"""Tool-calling conformance of `openk2 serve`, in the style of Moonshot's K2 Vendor Verifier.

Replays benchmarks/k2vv/requests.jsonl (~100 real-shaped tool-use requests; `k2vv/make_requests.py` writes it)
with the official `openai` client, `--concurrency` at a time, against `--base-url` (any OpenAI-compatible
server) or, with `--launch-tiny`, against a real `openk2 serve` it starts on a tiny untrained checkpoint
(`--server-args` are passed to it, e.g. "--strict-tool-calls --grammar-max-string-length 32"). Streamed requests
are read the way K2VV reads them (`choices[0]` of each chunk, tool-call deltas joined by index).

For every request it records HTTP status, finish_reason, the tool calls, latency (and time to first chunk when
streamed), and checks every call's arguments with `jsonschema` against the declared tool's `parameters`.
It writes `--out` (JSON: summary + per-request records) and the same as markdown next to it, and prints the
summary: finish-reason counts, tool-call trigger precision/recall/F1/agreement against `--reference` (a
previous run's JSON, e.g. the strict server), schema accuracy (all calls, and forced required/named calls),
tool_choice none and response_format compliance, 4xx/5xx counts, latency p50/p95.

Usage:
  python benchmarks/bench_conformance.py --launch-tiny --server-args="--strict-tool-calls" --out runs/k2vv/on.json
  python benchmarks/bench_conformance.py --base-url http://127.0.0.1:8000/v1 --reference runs/k2vv/on.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from k2vv.score import check, markdown, summarize  # noqa: E402

DEFAULT_REQUESTS = HERE / "k2vv" / "requests.jsonl"


def load_requests(path: Path, only: str | None = None, limit: int | None = None) -> list[dict]:
    """The request set (lines of {"id", "kind", "body"}), optionally only some kinds/ids and the first `limit`."""
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if only:
        keep = set(only.split(","))
        items = [it for it in items if it["kind"] in keep or it["id"] in keep]
    return items[:limit] if limit else items


def _stream_faults(chunk, seen: dict) -> list[str]:
    """Protocol faults of one streamed chunk (OpenAI's shape: one choices entry per index, and so on)."""
    faults, indices = [], [c.index for c in chunk.choices]
    if len(indices) != len(set(indices)):
        faults.append(f"chunk with {len(indices)} choices entries for indices {indices}")
    if chunk.choices and seen.get("finished"):
        faults.append("choices after the chunk with finish_reason")
    return faults


async def _read_stream(stream, record: dict, start: float, want_usage: bool) -> None:
    calls: dict[int, dict] = {}
    content, faults, seen, usage = [], [], {}, None
    async for chunk in stream:
        if record["ttft_s"] is None:
            record["ttft_s"] = time.perf_counter() - start
        faults += _stream_faults(chunk, seen)
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]  # K2VV's reader: the first entry only
        delta = choice.delta
        if delta is not None and delta.content:
            content.append(delta.content)
        for tc in (delta.tool_calls or []) if delta is not None else []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                slot["id"] = slot["id"] or tc.id
            fn = tc.function
            if fn is not None and fn.name:
                if slot["name"] is not None or slot["arguments"]:
                    faults.append(f"call {tc.index}: name sent again or after its arguments")
                slot["name"] = slot["name"] or fn.name
            if fn is not None and fn.arguments:
                slot["arguments"] += fn.arguments
        if choice.finish_reason is not None:
            record["finish_reason"] = choice.finish_reason
            seen["finished"] = True
    if want_usage and usage is None:
        faults.append("stream_options.include_usage but no usage chunk")
    record.update(content="".join(content), tool_calls=[calls[i] for i in sorted(calls)], protocol=faults,
                  completion_tokens=usage.completion_tokens if usage is not None else None,
                  prompt_tokens=usage.prompt_tokens if usage is not None else None)


async def replay_one(client, model: str, item: dict) -> dict:
    """Send one request; its record (see k2vv/score.py)."""
    import openai

    body = {**item["body"], "model": model}
    record = {"id": item["id"], "kind": item["kind"], "stream": bool(body.get("stream")), "status": 0,
              "error": None, "latency_s": None, "ttft_s": None, "finish_reason": None, "content": None,
              "tool_calls": [], "protocol": [], "completion_tokens": None,
              "prompt_tokens": None, "max_tokens": body.get("max_tokens")}
    start = time.perf_counter()
    try:
        if record["stream"]:
            stream = await client.chat.completions.create(**body)
            record["status"] = 200
            want = bool((body.get("stream_options") or {}).get("include_usage"))
            await _read_stream(stream, record, start, want)
        else:
            resp = await client.chat.completions.create(**body)
            record["status"] = 200
            choice = resp.choices[0]
            record["finish_reason"] = choice.finish_reason
            record["completion_tokens"] = resp.usage.completion_tokens if resp.usage else None
            record["prompt_tokens"] = resp.usage.prompt_tokens if resp.usage else None
            record["content"] = choice.message.content
            record["tool_calls"] = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                                    for c in choice.message.tool_calls or []]
    except openai.APIStatusError as err:
        record["status"], record["error"] = err.status_code, str(err)[:300]
    except (openai.APIConnectionError, openai.APIResponseValidationError) as err:
        record["error"] = f"{type(err).__name__}: {err}"[:300]
    record["latency_s"] = time.perf_counter() - start
    return record


async def replay(base_url: str, items: list[dict], model: str | None = None, concurrency: int = 4,
                 api_key: str = "unused", timeout: float = 600) -> list[dict]:
    """Replay `items` against an OpenAI-compatible `base_url` (…/v1), `concurrency` at a time; checked records
    in the order of `items`. `model` defaults to the first id /v1/models lists."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout)
    try:
        if model is None:
            model = (await client.models.list()).data[0].id
        gate = asyncio.Semaphore(concurrency)

        async def one(item: dict) -> dict:
            async with gate:
                return check(await replay_one(client, model, item), item)

        return list(await asyncio.gather(*(one(it) for it in items)))
    finally:
        await client.close()


def write_report(out: Path, summary: dict, records: list[dict], meta: dict) -> Path:
    """`out` (JSON: meta, summary, records) and its markdown twin; the markdown path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "records": records}, indent=1))
    md = out.with_suffix(".md")
    md.write_text(markdown(summary, records, f"Conformance run: {meta.get('label', out.stem)}"))
    return md


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")
    where.add_argument("--launch-tiny", action="store_true", help="start openk2 serve on a tiny random checkpoint")
    p.add_argument("--server-args", default="",
                   help='extra `openk2 serve` flags with --launch-tiny, as --server-args="--flag ..."')
    p.add_argument("--server-threads", type=int, default=1, help="torch threads of the launched server")
    p.add_argument("--model", default=None, help="model id (default: the first /v1/models lists)")
    p.add_argument("--api-key", default="unused")
    p.add_argument("--requests", type=Path, default=DEFAULT_REQUESTS)
    p.add_argument("--only", default=None, help="comma-separated kinds or ids to replay")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600, help="seconds per request")
    p.add_argument("--reference", type=Path, default=None, help="a previous run's JSON for trigger agreement")
    p.add_argument("--out", type=Path, default=Path("runs/k2vv/result.json"))
    p.add_argument("--label", default=None, help="a name for the run in the report")
    args = p.parse_args()
    if args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    items = load_requests(args.requests, args.only, args.limit)
    if not items:
        p.error("no requests selected")
    reference = json.loads(args.reference.read_text())["records"] if args.reference else None
    meta = {"label": args.label or args.out.stem, "requests": str(args.requests), "count": len(items),
            "concurrency": args.concurrency, "server_args": args.server_args if args.launch_tiny else None,
            "base_url": args.base_url, "reference": str(args.reference) if args.reference else None}
    start = time.perf_counter()
    if args.launch_tiny:
        from k2vv.launch import start_server, stop_server, write_tiny_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            ckpt = write_tiny_checkpoint(Path(tmp) / "tiny-k2vv")
            proc, base = start_server(ckpt, ["--max-seq-len", "6144", *shlex.split(args.server_args)],
                                      threads=args.server_threads)
            try:
                records = asyncio.run(replay(base + "/v1", items, args.model, args.concurrency, args.api_key,
                                             args.timeout))
            finally:
                stop_server(proc)
    else:
        records = asyncio.run(replay(args.base_url, items, args.model, args.concurrency, args.api_key,
                                     args.timeout))
    meta["wall_s"] = round(time.perf_counter() - start, 1)
    summary = summarize(records, reference)
    md = write_report(args.out, summary, records, meta)
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out} and {md}")
    return 1 if summary["http_5xx"] or summary["no_response"] else 0


if __name__ == "__main__":
    sys.exit(main())
