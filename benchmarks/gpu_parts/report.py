"""The GPU check's two outputs: gpu_check.json (every record as measured) and gpu_check.md (the same, readable)."""

from __future__ import annotations

import json
import os
from pathlib import Path

JSON_NAME, MD_NAME = "gpu_check.json", "gpu_check.md"
FAILING = ("failed", "error", "timeout")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    keys = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |" for row in rows]
    return lines


def markdown(run: dict) -> str:
    """The run as markdown: a header, one summary row per part, then each part's numbers."""
    env = next((p.get("metrics", {}) for p in run["parts"] if p["name"] == "env"), {})
    lines = [
        "# GPU check",
        "",
        f"- started {run['started']}, {run['wall_s']:.0f} s of a {run['budget_s']:.0f} s budget",
        f"- command: `{run['command']}`",
        f"- device: {env.get('device_name', run['device'])}; torch {env.get('torch', '?')} "
        f"(CUDA {env.get('torch_cuda', '?')}), transformers {env.get('transformers', '?')}, "
        f"python {env.get('python', '?')}",
        f"- machine: {env.get('machine', '?')}",
        f"- sizes: {'--quick (dry-run sizes, not a measurement of anything)' if run['quick'] else 'full'}",
        "",
        "| part | status | seconds | reason |",
        "|---|---|---:|---|",
    ]
    lines += [f"| {p['name']} | {p['status']} | {p.get('seconds', 0):.1f} | {_cell(p.get('reason', ''))} |"
              for p in run["parts"]]
    for p in run["parts"]:
        lines += ["", f"## {p['name']}: {p.get('title', '')}", "", f"status: **{p['status']}**"
                  + (f" ({p['reason']})" if p.get("reason") else "")]
        if p.get("metrics"):
            lines += [""] + _table([{"metric": k, "value": v} for k, v in p["metrics"].items()])
        for title, rows in p.get("tables", {}).items():
            lines += ["", f"{title}:", ""] + _table(rows)
        lines += [""] + [f"- {note}" for note in p.get("notes", [])] if p.get("notes") else []
    return "\n".join(lines) + "\n"


def _replace(path: Path, text: str) -> None:
    # The parent never imports torch (openk2.fileio would, through openk2/__init__), so a local atomic write.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write(out: Path, run: dict) -> None:
    """Write both files (atomically, so a kill mid-run leaves the last complete version)."""
    out.mkdir(parents=True, exist_ok=True)
    _replace(out / JSON_NAME, json.dumps(run, indent=2, default=str) + "\n")
    _replace(out / MD_NAME, markdown(run))
