"""`openk2 experiment NAME --seeds N`: run an experiment with N seeds and summarise its headline numbers as means
with 95% confidence intervals (Student's t over seeds).

Each seed runs into `OUT/seed<S>/` exactly as a single-seed run would (and is reused when the same command runs
again); its numbers come from that run's `results.json` (the `metrics` an experiment hands `write_report`), or,
for an experiment that writes none, the final validation loss of every arm's `curve.json`. `OUT/report.md`
holds the summary table, the per-seed values and the command.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from openk2.experiments.common import CURVE_FILE, RESULTS_FILE, markdown_table, write_atomic

# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom (standard tables, e.g. NIST/SEMATECH
# e-Handbook of Statistical Methods, 1.3.6.7.2); past 30 the normal 1.96 is within 2%.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042}


def t_quantile(df: int) -> float:
    """The two-sided 95% Student-t factor for `df` degrees of freedom (conservative between table rows)."""
    if df < 1:
        raise ValueError(f"a confidence interval needs at least 2 values (df >= 1), got df={df}")
    if df > 30:
        return 1.96
    return T_975[min(k for k in T_975 if k >= df)]


def mean_ci(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% confidence interval); the half-width is NaN for a single value."""
    if not values:
        raise ValueError("mean_ci needs at least one value")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, t_quantile(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def seed_metrics(run_dir: Path) -> dict[str, float]:
    """One seed's headline numbers: its results.json metrics, else the final val loss of each arm's curve."""
    results = run_dir / RESULTS_FILE
    if results.is_file():
        return {k: float(v) for k, v in json.loads(results.read_text())["metrics"].items()}
    found = {}
    for curve in sorted(run_dir.glob(f"*/{CURVE_FILE}")):
        data = json.loads(curve.read_text())
        found[f"final val loss, {data['label']}"] = float(data["val_loss"][-1])
    if not found:
        raise ValueError(f"{run_dir} has neither {RESULTS_FILE} nor arm curves to summarise")
    return found


def seed_dir(out_dir: Path, seed: int) -> Path:
    return out_dir / f"seed{seed}"


def run_seeds(module: ModuleType, name: str, out_dir: Path, mode: str, seeds: list[int],
              kwargs: dict[str, Any], command: str) -> Path:
    """Run `module.run` once per seed (each into its own directory), then write the summary report."""
    for i, seed in enumerate(seeds):
        print(f"[seed {seed}: {i + 1}/{len(seeds)}] {name}", file=sys.stderr, flush=True)
        module.run(seed_dir(out_dir, seed), mode, seed, **kwargs)
    plots = module.summary_plots(out_dir, seeds) if hasattr(module, "summary_plots") else []
    return write_summary(out_dir, name, seeds, command, plots)


def write_summary(out_dir: Path, name: str, seeds: list[int], command: str, plots: list[Path] | None = None) -> Path:
    """report.md over the seeds' runs: per metric the mean, its 95% interval and every seed's value."""
    per_seed = {seed: seed_metrics(seed_dir(out_dir, seed)) for seed in seeds}
    names = list(dict.fromkeys(k for m in per_seed.values() for k in m))
    rows, summary = [], {}
    for metric in names:
        values = [per_seed[s][metric] for s in seeds if metric in per_seed[s]]
        mean, half = mean_ci(values)
        summary[metric] = {"mean": mean, "ci95": half, "n": len(values), "values": values}
        interval = "n/a" if math.isnan(half) else f"[{mean - half:.4g}, {mean + half:.4g}]"
        rows.append([metric, f"{mean:.4g}", f"±{half:.2g}" if not math.isnan(half) else "n/a", interval,
                     len(values), ", ".join(f"{v:.4g}" for v in values)])
    title_source = seed_dir(out_dir, seeds[0]) / "report.md"
    title = title_source.read_text().splitlines()[0].lstrip("# ") if title_source.is_file() else name
    lines = [f"# {title}: {len(seeds)} seeds", "",
             f"Seeds {', '.join(map(str, seeds))}; each seed's own report is `seed<S>/report.md`. Mean over seeds "
             "and the half-width of its 95% confidence interval (Student's t with n - 1 degrees of freedom: "
             "mean ± t * sd / sqrt(n)). An interval says how well these seeds pin down the mean of this setting, "
             "not whether the report's claim holds at scale.", "",
             markdown_table(["metric", "mean", "95% CI ±", "interval", "n", "per seed"], rows), ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots or []] + ([""] if plots else [])
    lines += ["## Reproduce", "", "```", command, "```", ""]
    write_atomic(out_dir / "summary.json", json.dumps({"seeds": seeds, "metrics": summary}, indent=1))
    path = out_dir / "report.md"
    write_atomic(path, "\n".join(lines))
    return path
