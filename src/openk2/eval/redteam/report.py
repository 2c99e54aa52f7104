"""Pass rates from attempt records, and the files that show them: results.json, table.md, heatmap.png.

A cell's pass rate is the share of its judged attempts whose verdict is PASS (the target stayed safe), with a
Wilson 95% interval (`openk2.eval.base.wilson_interval`); higher is safer, as in the report's safety table.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from openk2.eval.base import Aggregate, wilson_interval
from openk2.eval.redteam.strategies import STRATEGIES
from openk2.fileio import atomic_write_text

RESULTS_FILE = "results.json"
TABLE_FILE = "table.md"
HEATMAP_FILE = "heatmap.png"


def pass_rate(records: Sequence[dict]) -> Aggregate:
    """Share of `records` judged PASS, with its Wilson interval."""
    return wilson_interval(sum(1 for r in records if r["verdict"] == "PASS"), len(records))


def summarise(records: Sequence[dict], plugins: Sequence[str], strategies: Sequence[str]) -> dict[str, Any]:
    """Pass rates per cell (`cells[plugin][strategy]`), per plugin, per strategy and overall."""
    def rate(keep) -> dict[str, Any]:  # an empty selection has no rate: None rather than NaN (strict JSON)
        row = asdict(pass_rate([r for r in records if keep(r)]))
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}

    return {
        "cells": {p: {s: rate(lambda r, p=p, s=s: r["plugin"] == p and r["strategy"] == s) for s in strategies}
                  for p in plugins},
        "plugins": {p: rate(lambda r, p=p: r["plugin"] == p) for p in plugins},
        "strategies": {s: rate(lambda r, s=s: r["strategy"] == s) for s in strategies},
        "overall": rate(lambda r: True),
        "judge_fallbacks": sum(1 for r in records if r.get("judge_method") == "keywords"),
        "attacker_fallbacks": sum(1 for r in records for step in r.get("rounds", []) if step.get("attacker_fallback")),
        "attacker_prompts": sum(len(r.get("rounds", [])) for r in records),
    }


def write_report(out: Path, records: Sequence[dict], plugins: Sequence[str], strategies: Sequence[str],
                 settings: dict[str, Any], errors: int = 0, heatmap: bool = True) -> dict[str, Any]:
    """Write results.json, table.md and (unless `heatmap` is False) heatmap.png for `records` into `out`;
    returns the results payload."""
    payload = {"settings": settings, "errors": errors, **summarise(records, plugins, strategies)}
    atomic_write_text(out / RESULTS_FILE, json.dumps(payload, indent=2, default=str))
    atomic_write_text(out / TABLE_FILE, format_table(payload))
    if heatmap:
        plot_heatmap(payload, out / HEATMAP_FILE)
    return payload


def _label(strategy: str) -> str:
    return STRATEGIES[strategy][1] if strategy in STRATEGIES else strategy


def _cell_text(row: dict[str, Any]) -> str:
    if not row["n"]:
        return "-"
    return f"{100 * row['value']:.0f}% [{100 * row['low']:.0f}, {100 * row['high']:.0f}] n={row['n']}"


def format_table(payload: dict[str, Any]) -> str:
    """The plugin x strategy pass-rate table (markdown), with per-plugin and per-strategy totals."""
    s = payload["settings"]
    strategies = list(payload["strategies"])
    lines = [f"# Red-team pass rates: target `{s['target']}`", "",
             f"attacker `{s['attacker']}`, judge `{s['judge']}`, seed {s['seed']}. Pass = the target stayed safe; "
             "cells show pass rate [Wilson 95% interval] and attempts n.", "",
             "| plugin | " + " | ".join(_label(x) for x in strategies) + " | all |",
             "|---|" + "---|" * (len(strategies) + 1)]
    for plugin, row in payload["cells"].items():
        cells = [_cell_text(row[x]) for x in strategies] + [_cell_text(payload["plugins"][plugin])]
        lines.append(f"| {plugin.capitalize()} | " + " | ".join(cells) + " |")
    totals = [_cell_text(payload["strategies"][x]) for x in strategies] + [_cell_text(payload["overall"])]
    lines.append("| **all** | " + " | ".join(totals) + " |")
    lines += ["", f"Judge answers unreadable (keyword fallback used): {payload['judge_fallbacks']}; "
              f"attacker prompts replaced by the scripted fallback: {payload['attacker_fallbacks']} of "
              f"{payload['attacker_prompts']}; attempts that raised: {payload['errors']}."]
    return "\n".join(lines) + "\n"


def plot_heatmap(payload: dict[str, Any], path: Path) -> Path:
    """A plugin x strategy heatmap of pass rates (red = attacks got through, green = safe); empty cells grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    plugins, strategies = list(payload["cells"]), list(payload["strategies"])
    rates = np.array([[payload["cells"][p][s]["value"] if payload["cells"][p][s]["n"] else np.nan
                       for s in strategies] for p in plugins], dtype=float)
    fig, ax = plt.subplots(figsize=(1.6 * len(strategies) + 2.5, 0.7 * len(plugins) + 1.8))
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey")
    image = ax.imshow(np.ma.masked_invalid(rates), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(strategies)), [_label(s) for s in strategies], rotation=20, ha="right")
    ax.set_yticks(range(len(plugins)), [p.capitalize() for p in plugins])
    for i, plugin in enumerate(plugins):
        for j, strategy in enumerate(strategies):
            n = payload["cells"][plugin][strategy]["n"]
            text = "-" if not n or math.isnan(rates[i, j]) else f"{100 * rates[i, j]:.0f}%\nn={n}"
            ax.text(j, i, text, ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="pass rate")
    ax.set_title(f"Red-team pass rate: {payload['settings']['target']}")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return path
