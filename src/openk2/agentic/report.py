"""The acceptance report of a synthesis run: `report.md` plus two plots, from `stages.json` (`stage_stats`).

`funnel.png` shows how many items each stage asked for and kept; `rejections.png` the most common rejection
reasons of every stage (for trajectories: simulated-user replies rejected by `user_check`) and the tool
simulator's outcomes. Written with matplotlib's file-only backend.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_ORDER = ("domains", "tools", "agents", "tasks", "trajectories", "judged")


def _kept(name: str, st: dict) -> tuple[int, int]:
    """(asked, kept) of one stage."""
    if name == "tools":
        return st.get("proposed", 0), st.get("valid", 0)
    if name == "agents":
        return st.get("produced", 0), st.get("prompt_from_model", 0)
    if name == "judged":
        return st.get("judged", 0), st.get("accepted", 0)
    return st.get("asked", 0), st.get("produced", 0)


def _pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def write_plots(stages: dict[str, dict], out: Path) -> list[str]:
    """funnel.png and rejections.png in `out`; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in _ORDER if n in stages]
    asked = [_kept(n, stages[n])[0] for n in names]
    kept = [_kept(n, stages[n])[1] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], asked, width=0.4, label="asked / proposed")
    ax.bar([x + 0.2 for x in xs], kept, width=0.4, label="kept")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("items")
    ax.set_title("synthesis funnel")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "funnel.png", dpi=100)
    plt.close(fig)

    rows = [(f"{n}: {reason[:50]}", count) for n in names for reason, count in
            list(stages[n].get("rejections", {}).items())[:4]]
    rows += [(f"tool call: {k}", v) for k, v in stages.get("trajectories", {}).get("tool_outcomes", {}).items()]
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.3 * len(rows) + 1)))
    if rows:
        ax.barh([r[0] for r in rows][::-1], [r[1] for r in rows][::-1])
    ax.set_xlabel("count")
    ax.set_title("rejection reasons and tool-call outcomes")
    fig.tight_layout()
    fig.savefig(out / "rejections.png", dpi=100)
    plt.close(fig)
    return ["funnel.png", "rejections.png"]


def render_markdown(report: dict[str, Any], plots: list[str]) -> str:
    """The report's markdown text."""
    stages = report["stages"]
    lines = ["# Synthesis run: acceptance at every stage", "",
             f"Wall time this run: {report.get('seconds')} s; completion tokens: {report.get('completion_tokens')} "
             f"({report.get('tokens_per_second')} tokens/s).", "",
             "| stage | asked | kept | acceptance | notes |", "|---|---:|---:|---:|---|"]
    for name in (n for n in _ORDER if n in stages):
        st = stages[name]
        asked, kept = _kept(name, st)
        notes = []
        if name == "tools":
            notes.append(f"{st.get('dropped_as_duplicates', 0)} dropped as duplicates (dedup rate "
                         f"{_pct(st.get('dedup_rate'))}), repository {st.get('repository')} ({st.get('mcp')} MCP)")
        if name == "tasks":
            notes.append(f"{st.get('duplicate_instructions', 0)} duplicate instructions")
        if name == "trajectories":
            notes.append(f"user-simulator replies rejected {st.get('user_turns_rejected', 0)} (episodes ended by it: "
                         f"{st.get('end_reasons', {}).get('user_rejected', 0)})")
            notes.append(f"tool-call validity {_pct(st.get('tool_call_validity'))} of {st.get('tool_calls')} calls; "
                         f"{st.get('with_tool_calls')} with calls; results from {st.get('result_sources')}; "
                         f"ends {st.get('end_reasons')}")
        lines.append(f"| {name} | {asked} | {kept} | {_pct(st.get('acceptance_rate'))} | {'; '.join(notes)} |")
    lines += ["", "## Rejection reasons", ""]
    for name in (n for n in _ORDER if n in stages):
        rejections = stages[name].get("rejections") or {}
        if rejections:
            lines.append(f"- **{name}**: " + "; ".join(f"{r} ({n})" for r, n in rejections.items()))
    lines += ["", "## Throughput (this run)", "", "| stage | items | seconds | items/min |", "|---|---:|---:|---:|"]
    for name, t in report.get("throughput", {}).items():
        lines.append(f"| {name} | {t['items']} | {t['seconds']} | {t['items_per_minute']} |")
    lines += ["", "| role | model calls | completion tokens |", "|---|---:|---:|"]
    for role, u in report.get("usage", {}).items():
        lines.append(f"| {role} | {u.get('calls', 0)} | {u.get('completion_tokens', 0)} |")
    lines += ["", "## Structured output (this run)", "", "| role | requests | model calls | gave up | failures |",
              "|---|---:|---:|---:|---|"]
    for role, s in report.get("structured_output", {}).items():
        lines.append(f"| {role} | {s['requests']} | {s['attempts']} | {s['gave_up']} | {s['failures']} |")
    lines += [""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)


def write_report(run_dir: str | Path) -> Path:
    """report.md (and its plots) in `run_dir` from its stages.json, or from its stores when the run was
    interrupted before writing one; returns the report's path."""
    from openk2.agentic.stage_stats import stage_stats_on_disk

    run_dir = Path(run_dir)
    path = run_dir / "stages.json"
    report = json.loads(path.read_text()) if path.is_file() else stage_stats_on_disk(run_dir)
    plots = write_plots(report["stages"], run_dir)
    out = run_dir / "report.md"
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text(render_markdown(report, plots))
    tmp.replace(out)
    return out
