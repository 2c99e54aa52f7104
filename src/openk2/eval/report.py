"""`openk2 eval report DIR`: one run's results as a report a researcher can cite.

For every benchmark in `DIR/results.json`: the score with its 95% interval and n, the settings that decide
whether it compares with a published number (scorer, runner, step limits, trials, user model, prompts), and the
K2-Instruct number the K2 report (arXiv:2507.20534) publishes for that benchmark, where it publishes one. If any
BFCL category was run, BFCL's weighted overall follows, with the categories it is missing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from openk2.eval.bfcl_overall import overall as bfcl_overall
from openk2.eval.harness import load_results

# benchmark name prefix -> (what the report measured, K2-Instruct's number); the K2 report's text gives one
# τ²-Bench number (Pass@1 over its domains), not one per domain, and no BFCL number.
PUBLISHED: dict[str, tuple[str, float]] = {
    "tau2-": ("τ²-Bench Pass@1 over its domains (retail, airline, telecom together)", 66.1),
    "acebench": ("ACEBench (En)", 76.5),
}
# run settings that bear on comparability, with how to read them
_RUN_SETTINGS = (("model", "model under test"), ("user_model", "user simulator"), ("judge", "judge"),
                 ("temperature", "temperature"), ("max_tokens", "max tokens per turn"),
                 ("samples_per_problem", "samples / trials per problem"), ("k", "k (pass@k / pass^k)"),
                 ("seed", "run seed"))


def published(name: str) -> tuple[str, float] | None:
    """The report's K2-Instruct number for benchmark `name`, if it gives one."""
    return next((v for prefix, v in PUBLISHED.items() if name.startswith(prefix)), None)


def _fmt(x: Any, scale: float = 100.0) -> str:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return "n/a"
    return "n/a" if not math.isfinite(x) else f"{x * scale:.1f}"


def build_report(run_dir: str | Path) -> str:
    """The markdown report of one evaluation directory."""
    payload = load_results(run_dir)
    settings, rows = payload["settings"], payload["benchmarks"]
    lines = [f"# Evaluation report: `{settings.get('model')}`", "",
             "Scores in percent with 95% intervals; the K2-Instruct column is the K2 report's number, for reference "
             "only where the settings below match its evaluation.", "",
             "| setting | value |", "|---|---|"]
    lines += [f"| {label} | {settings.get(key)} |" for key, label in _RUN_SETTINGS]
    lines += ["", "| benchmark | metric | ours | 95% interval | n | K2-Instruct (report) |",
              "|---|---|---|---|---|---|"]
    for name, row in sorted(rows.items()):
        pub = published(name)
        scale = 100.0 if row.get("metric") != "perplexity" else 1.0
        lines.append(f"| {name} | {row['metric']} | {_fmt(row['value'], scale)} | [{_fmt(row['low'], scale)}, "
                     f"{_fmt(row['high'], scale)}] | {row['n']} | {f'{pub[1]:.1f} ({pub[0]})' if pub else '-'} |")
    for name, row in sorted(rows.items()):
        lines += ["", f"## {name}", "", "| setting | value |", "|---|---|"]
        lines.append(f"| score | {_fmt(row['value'])} [{_fmt(row['low'])}, {_fmt(row['high'])}], n = {row['n']} |")
        for key, value in (row.get("settings") or {}).items():
            lines.append(f"| {key} | {value} |")
        if name.startswith("tau2-"):
            lines.append(f"| user model | {settings.get('user_model') or 'scripted (oracle) or none'} |")
        if name.startswith("tau2-") and "trials" not in (row.get("settings") or {}):
            lines.append(f"| trials (pass^k over n) | {settings.get('samples_per_problem')} "
                         f"(k = {settings.get('k')}) |")
        pub = published(name)
        if pub:
            lines.append(f"| K2-Instruct (report) | {pub[1]:.1f}: {pub[0]} |")
    if any(name.startswith("bfcl-") for name in rows):
        lines += _bfcl_section(rows)
    return "\n".join(lines) + "\n"


def _bfcl_section(rows: dict[str, dict]) -> list[str]:
    result = bfcl_overall(rows)
    lines = ["", "## BFCL v4 overall", "",
             "bfcl-eval's formula: (10 Non-Live + 10 Live + 10 Irrelevance + 30 Multi-Turn + 40 Agentic) / 100, a "
             "category not run counting 0 (as in BFCL).", "", "| group | score |", "|---|---|"]
    lines += [f"| {group} | {_fmt(value)} |" for group, value in result["groups"].items()]
    lines.append(f"| **overall** | **{_fmt(result['overall'])}** |")
    present_only = result["present_only"]
    lines += ["", f"Categories run: {', '.join(result['categories_present']) or 'none'}.",
              f"Categories not run (counted 0): {', '.join(result['categories_absent']) or 'none'}.",
              f"Over the complete groups only ({', '.join(result['complete_groups']) or 'none'}), weights "
              f"renormalised: {_fmt(present_only) if present_only is not None else 'n/a'}."]
    return lines
