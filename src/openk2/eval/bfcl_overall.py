"""BFCL v4's overall score from per-category accuracies, as bfcl-eval's leaderboard computes it.

`generate_leaderboard_csv` in bfcl-eval: Non-Live = unweighted mean of simple (itself the mean of Python, Java
and JavaScript), multiple, parallel and parallel_multiple; Live = the count-weighted mean of the four live AST
categories; Irrelevance = the mean of non-live and live irrelevance; Multi-Turn = the mean of base, miss_func,
miss_param and long_context; Agentic = web search and memory. Overall = (10 Non-Live + 10 Live + 10 Irrelevance
+ 30 Multi-Turn + 40 Agentic) / 100. A category that was not run counts 0, as in BFCL, so `categories_absent`
says what the number is missing (openk2 runs no Java, JavaScript, web search or memory: they need other runtimes
or the network), and `present_only` renormalises the weights over the groups that have every category.
"""

from __future__ import annotations

from typing import Any

# BFCL category -> openk2 benchmark name (None: not offered by openk2)
BENCHMARKS: dict[str, str | None] = {
    "simple_python": "bfcl-simple", "simple_java": None, "simple_javascript": None,
    "multiple": "bfcl-multiple", "parallel": "bfcl-parallel", "parallel_multiple": "bfcl-parallel-multiple",
    "irrelevance": "bfcl-irrelevance", "live_simple": "bfcl-live-simple", "live_multiple": "bfcl-live-multiple",
    "live_parallel": "bfcl-live-parallel", "live_parallel_multiple": "bfcl-live-parallel-multiple",
    "live_irrelevance": "bfcl-live-irrelevance", "multi_turn_base": "bfcl-multi-turn",
    "multi_turn_miss_func": "bfcl-multi-turn-miss-func", "multi_turn_miss_param": "bfcl-multi-turn-miss-param",
    "multi_turn_long_context": "bfcl-multi-turn-long-context", "web_search_base": None,
    "web_search_no_snippet": None, "memory_kv": None, "memory_vector": None, "memory_rec_sum": None,
}
WEIGHTS = {"non_live": 10, "live": 10, "irrelevance": 10, "multi_turn": 30, "agentic": 40}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def overall(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """BFCL's group scores and overall from `rows` (benchmark name -> {"value", "n"}, as in results.json)."""
    acc: dict[str, float] = {}
    count: dict[str, int] = {}
    present, absent = [], []
    for category, bench in BENCHMARKS.items():
        row = rows.get(bench) if bench else None
        if row is not None and isinstance(row.get("value"), (int, float)) and row.get("n"):
            acc[category], count[category] = float(row["value"]), int(row["n"])
            present.append(category)
        else:
            acc[category], count[category] = 0.0, 0
            absent.append(category)
    simple = _mean([acc["simple_python"], acc["simple_java"], acc["simple_javascript"]])
    live = ["live_simple", "live_multiple", "live_parallel", "live_parallel_multiple"]
    live_n = sum(count[c] for c in live)
    groups = {
        "non_live": _mean([simple, acc["multiple"], acc["parallel"], acc["parallel_multiple"]]),
        "live": sum(acc[c] * count[c] for c in live) / live_n if live_n else 0.0,
        "irrelevance": _mean([acc["irrelevance"], acc["live_irrelevance"]]),
        "multi_turn": _mean([acc[c] for c in BENCHMARKS if c.startswith("multi_turn_")]),
        "agentic": _mean([_mean([acc["web_search_base"], acc["web_search_no_snippet"]]),
                          _mean([acc["memory_kv"], acc["memory_vector"], acc["memory_rec_sum"]])]),
    }
    members = {"non_live": ["simple_python", "simple_java", "simple_javascript", "multiple", "parallel",
                            "parallel_multiple"], "live": live, "irrelevance": ["irrelevance", "live_irrelevance"],
               "multi_turn": [c for c in BENCHMARKS if c.startswith("multi_turn_")],
               "agentic": ["web_search_base", "web_search_no_snippet", "memory_kv", "memory_vector", "memory_rec_sum"]}
    complete = [g for g, cats in members.items() if all(c in present for c in cats)]
    weight = sum(WEIGHTS[g] for g in complete)
    return {"overall": sum(WEIGHTS[g] * groups[g] for g in WEIGHTS) / sum(WEIGHTS.values()), "groups": groups,
            "categories_present": present, "categories_absent": absent, "complete_groups": complete,
            "present_only": sum(WEIGHTS[g] * groups[g] for g in complete) / weight if weight else None}
