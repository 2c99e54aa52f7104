"""Prompt-head KV reuse across `generate` calls in the `hf:` backend (openk2.llm.hf_kvstore), on `hf:smollm2`.

An episodes-stage-like call mix: `--agents` agents, each a system prompt plus its tool list (as SmolLM2's
template gets it: `tools_instruction`), and `--batches` consecutive batches of `--rows` first agent turns (forced
tool calls, greedy, `--max-tokens` each), rows spread over the agents. Three settings run the same batches on
the same loaded weights: no sharing (`min_shared_prefix=0`), in-batch sharing only (`prefix_cache_mb=0`, the
backend before the store), sharing plus the store with every rest padded to the longest (before
`batched_rest_width`), and the default (long rests prefilled alone). `--loners` adds rows per batch that share
no head (a long rest each), as user-simulator rows do in a batch of agent turns. Reported: CPU seconds of the
generating thread (`time.thread_time`, so other processes' load mostly drops out) per setting, median over
`--repeats` rounds (a fresh store each round), prompt tokens and those not prefilled again, and whether the
greedy replies of all settings are identical.

Usage: OMP_NUM_THREADS=1 python benchmarks/bench_hf_prefix_store.py --agents 3 --rows 8 --batches 3 --repeats 3
       OMP_NUM_THREADS=1 python benchmarks/bench_hf_prefix_store.py --agents 3 --rows 14 --loners 2 --batches 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import machine_summary, quiet_transformers

from openk2.llm import hf_prefix
from openk2.llm.hf_backend import HFChatModel

WORDS = ("order", "invoice", "shipment", "refund", "customer", "account", "balance", "schedule", "report", "ticket")


def _agent(k: int) -> tuple[dict, list[dict]]:
    """Agent k's system message and three tools (distinct names and descriptions per agent)."""
    topic = WORDS[k % len(WORDS)]
    system = {"role": "system", "content": (f"You are the {topic} desk assistant of shop number {k}. Be exact, "
                                            "polite and brief; confirm ids before changing records; never invent "
                                            "results. " * 4)}
    tools = [{"type": "function", "function": {
        "name": f"{verb}_{topic}_{k}", "description": f"{verb.title()} a {topic} record of shop {k} by its id.",
        "parameters": {"type": "object", "properties": {f"{topic}_id": {"type": "string"},
                                                        "note": {"type": "string"}},
                       "required": [f"{topic}_id"]}}} for verb in ("get", "update", "cancel")]
    return system, tools


def _batches(agents: int, rows: int, batches: int, loners: int = 0) -> list[list[tuple[list[dict], list[dict]]]]:
    out = []
    for b in range(batches):
        batch = [([{"role": "user", "content": f"Request {b}-{j}: " + "please check every record again. " * 12}],
                  _agent(agents + b * loners + j)[1]) for j in range(loners)]  # no head shared with anyone
        for r in range(rows):
            k = (b + r) % agents
            system, tools = _agent(k)
            batch.append(([system, {"role": "user", "content": f"Please look at {WORDS[r % 10]} {100 + 7 * r + b}."}],
                          tools))
        out.append(batch)
    return out


def _round(model: HFChatModel, batches: list, max_tokens: int) -> tuple[float, list, dict]:
    if model.kv_store is not None:
        model.kv_store = type(model.kv_store)(model.kv_store.max_bytes)  # a fresh store each round
    model.prefix_stats = {"prompt_tokens": 0, "shared_tokens": 0}
    sampling = {"temperature": 0.0, "max_tokens": max_tokens, "tool_choice": "required"}
    cpu, replies = 0.0, []
    for batch in batches:
        plans = [model._plan(m, t, dict(sampling)) for m, t in batch]
        t0 = time.thread_time()
        got = model._generate(plans)
        cpu += time.thread_time() - t0
        replies += [[c["function"]["arguments"] for c in r[0].tool_calls] + [r[0].content] for r in got]
    return cpu, replies, dict(model.prefix_stats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loners", type=int, default=0, help="rows per batch that share no head (a long rest each)")
    args = ap.parse_args()
    quiet_transformers()
    settings = {"no sharing": {"min_shared_prefix": 0, "prefix_cache_mb": 0},
                "in-batch sharing": {"prefix_cache_mb": 0},
                "in-batch sharing + store, long rests padded": {"prefix_cache_mb": 512},
                "in-batch sharing + store": {"prefix_cache_mb": 512}}
    models = {name: HFChatModel("smollm2", **kw) for name, kw in settings.items()}
    batches = _batches(args.agents, args.rows, args.batches, args.loners)
    results: dict[str, dict] = {name: {"cpu_s": []} for name in settings}
    default_overhead = hf_prefix.ROW_OVERHEAD
    replies: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, model in models.items():  # interleaved, so slow phases of the machine hit every setting
            hf_prefix.ROW_OVERHEAD = 10**9 if "padded" in name else default_overhead  # 10**9: never split
            cpu, got, stats = _round(model, batches, args.max_tokens)
            results[name]["cpu_s"].append(round(cpu, 2))
            results[name].update(stats)
            replies[name] = got
    for r in results.values():
        r["cpu_s_median"] = statistics.median(r["cpu_s"])
    identical = len({json.dumps(r) for r in replies.values()}) == 1
    print(json.dumps({"machine": machine_summary(), "args": vars(args), "results": results,
                      "greedy_replies_identical": identical, "head_forward_cpu_s": _head_logits(models, args)},
                     indent=1))


def _head_logits(models: dict, args: argparse.Namespace) -> dict:
    """CPU seconds of one forward over an agent's prompt head: every position's logits (what the head prefill
    computed before) against the last position's only (`logits_to_keep=1`, what it computes now); medians."""
    import torch

    model = next(iter(models.values()))
    system, tools = _agent(0)
    head = model._plan([system, {"role": "user", "content": "x"}], tools, {"tool_choice": "required"}).prompt[:-8]
    ids = torch.tensor([head])
    out = {"head_tokens": len(head)}
    for keep in (0, 1):
        times = []
        for _ in range(args.repeats):
            t0 = time.thread_time()
            with torch.no_grad():
                model.model(input_ids=ids, use_cache=True, logits_to_keep=keep)
            times.append(time.thread_time() - t0)
        out["all_logits" if keep == 0 else "last_logits"] = round(statistics.median(times), 3)
    return out


if __name__ == "__main__":
    main()
