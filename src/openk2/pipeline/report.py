"""`<out>/report.md`: what each stage ran, how long it took, its key numbers, the evaluations across stages, plots.

Every number is read from what the stages wrote (DONE manifests, `metrics.jsonl`, `toolcall_eval.json`, the
harness's `results.json`); a number a stage did not produce is shown as "-", never estimated. The training
plots are the trainers' own (`openk2.train.metrics.plot_run`, `openk2.rl.trainer.plot_rl_curves`, redrawn here
if missing); `eval_stages.png` is drawn here: one panel per benchmark, one bar per evaluated stage.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from openk2.fileio import atomic_write_text
from openk2.pipeline.stages import LOG_FILE, Stage

REPORT_FILE = "report.md"
EVAL_PLOT = "eval_stages.png"


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    return str(x)


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    from openk2.train.metrics import read_metrics

    try:
        return read_metrics(run_dir)
    except ValueError:
        return []


def _last(records: list[dict[str, Any]], key: str) -> Any:
    values = [r[key] for r in records if key in r]
    return values[-1] if values else None


def _first(records: list[dict[str, Any]], key: str) -> Any:
    values = [r[key] for r in records if key in r]
    return values[0] if values else None


def training_numbers(run_dir: Path) -> dict[str, Any]:
    """Final train loss, validation loss vs the unigram baseline, largest max-logit, steps, tokens seen."""
    records = _metrics(run_dir)
    max_logits = [r["max_logit"] for r in records if isinstance(r.get("max_logit"), int | float)]
    return {"steps": _last(records, "step"), "loss": _last(records, "loss"), "val_loss": _last(records, "val_loss"),
            "unigram_val_loss": _last(records, "unigram_val_loss"),
            "max_logit": max(max_logits) if max_logits else None, "tokens_seen": _last(records, "tokens_seen")}


def toolcall_numbers(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "toolcall_eval.json"
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    return {f"{when}_{key}": record[when][key] for when in ("before", "after") if when in record
            for key in ("well_formed_rate", "well_formed", "prompts")}


def rl_numbers(run_dir: Path) -> dict[str, Any]:
    """Held-out reward (greedy and sampled) at the first and last evaluation, training reward at both ends."""
    records = _metrics(run_dir)
    evals = [r for r in records if "eval_reward" in r]
    rewards = [r["reward_mean"] for r in records if isinstance(r.get("reward_mean"), float)
               and math.isfinite(r["reward_mean"])]
    window = min(5, len(rewards))
    return {
        "iterations": _last(records, "step"),
        "eval_first_step": evals[0]["step"] if evals else None, "eval_last_step": evals[-1]["step"] if evals else None,
        "eval_reward_first": _first(evals, "eval_reward"), "eval_reward_last": _last(evals, "eval_reward"),
        "eval_sampled_first": _first(evals, "eval_reward_sampled"),
        "eval_sampled_last": _last(evals, "eval_reward_sampled"),
        "train_reward_first": sum(rewards[:window]) / window if window else None,
        "train_reward_last": sum(rewards[-window:]) / window if window else None, "window": window,
    }


def eval_results(eval_dir: Path) -> dict[str, dict[str, Any]]:
    """{benchmark: {metric, value, low, high, n, ...}} from the harness's results.json (empty if absent)."""
    path = eval_dir / "results.json"
    if not path.is_file():
        return {}
    table = json.loads(path.read_text()).get("benchmarks", {})
    return {name: {k: _number(v) if k in ("value", "low", "high") else v for k, v in row.items()}
            for name, row in table.items()}


def _number(x: Any) -> Any:
    """results.json writes NaN as the string "nan"; turn such strings back into floats."""
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return x
    return x


def _failed_attempts(out: Path) -> dict[str, int]:
    """Per stage, the failed attempts of its current output: those after its last reset and before its last
    success (or, for an unfinished stage, since its last reset or success), from pipeline.jsonl."""
    path = out / LOG_FILE
    pending: dict[str, int] = {}
    final: dict[str, int] = {}
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        stage, status = record.get("stage"), record.get("status")
        if status == "failed":
            pending[stage] = pending.get(stage, 0) + 1
        elif status == "ran":
            final[stage], pending[stage] = pending.get(stage, 0), 0
        elif status == "reset":
            final.pop(stage, None)
            pending[stage] = 0
    return {stage: final.get(stage, 0) + pending.get(stage, 0) for stage in set(final) | set(pending)}


def _rel(out: Path, path: Path) -> str:
    return os.path.relpath(path, out)


def _stage_summary(stage: Stage, info: dict[str, Any]) -> str:
    """One line of key numbers for the stage table."""
    name, d = stage.name, stage.directory
    if name == "tokenizer":
        return (f"vocab {_fmt(info.get('vocab_size'))} ({_fmt(info.get('bpe_tokens'))} BPE), "
                f"trained on {info.get('train_chars', 0):,} chars")
    if name in ("pretrain", "sft"):
        t = training_numbers(d)
        text = (f"{_fmt(t['steps'])} steps; loss {_fmt(t['loss'])}, val {_fmt(t['val_loss'])} "
                f"(unigram {_fmt(t['unigram_val_loss'])}); max logit {_fmt(t['max_logit'], 1)}")
        if name == "sft":
            tc = toolcall_numbers(d)
            if tc:
                text += (f"; well-formed tool calls {_fmt(tc.get('before_well_formed_rate'))} -> "
                         f"{_fmt(tc.get('after_well_formed_rate'))}")
        return text
    if name == "rl":
        r = rl_numbers(d)
        return (f"{_fmt(r['iterations'])} iterations; held-out reward greedy {_fmt(r['eval_reward_first'])} -> "
                f"{_fmt(r['eval_reward_last'])}, T=1 {_fmt(r['eval_sampled_first'])} -> "
                f"{_fmt(r['eval_sampled_last'])}")
    results = eval_results(d)
    return ", ".join(f"{b} {_fmt(v.get('value'))}" for b, v in results.items()) or "-"


def write_report(out: Path, stages: list[Stage]) -> Path:
    """Write report.md (and eval_stages.png) for the stages in `out`; returns the report's path."""
    out = Path(out)
    failed = _failed_attempts(out)
    lines = ["# openk2 pipeline report", "",
             "Every number below was read from the stages' own outputs. Times are those of the invocation that",
             "finished each stage (a resumed stage counts only its last attempt); CPU is user + system time of",
             "the process, all threads; load is the machine's 1-minute load average at the stage's start and end",
             "(above the core count, other work shared the CPUs and the wall time is inflated).", "",
             "| stage | wall s | CPU s | load | attempts | key numbers |", "|---|---|---|---|---|---|"]
    total_wall = total_cpu = 0.0
    for stage in stages:
        manifest = stage.manifest()
        if manifest is None:
            lines.append(f"| {stage.name} | - | - | - | {failed.get(stage.name, 0)} failed | not finished |")
            continue
        info = manifest.get("info", {})
        total_wall += manifest["wall_s"]
        total_cpu += manifest["cpu_s"]
        attempts = 1 + failed.get(stage.name, 0)
        resumed = f", resumed from {info['resumed_from']}" if info.get("resumed_from") else ""
        load = "-".join(f"{x:.1f}" for x in info.get("load_average", [])) or "-"
        lines.append(f"| {stage.name} | {manifest['wall_s']:.1f} | {manifest['cpu_s']:.1f} | {load} | "
                     f"{attempts}{resumed} | {_stage_summary(stage, info)} |")
    lines += [f"| **total** | {total_wall:.1f} | {total_cpu:.1f} | | | |", ""]

    lines += _training_section(out, stages)
    lines += _eval_section(out, stages)
    return atomic_write_text(out / REPORT_FILE, "\n".join(lines) + "\n")


def _training_section(out: Path, stages: list[Stage]) -> list[str]:
    from openk2.rl.trainer import CURVES_FILE, plot_rl_curves
    from openk2.train.metrics import plot_run

    lines = ["## Training", ""]
    by_name = {s.name: s for s in stages}
    for name in ("pretrain", "sft"):
        stage = by_name[name]
        if stage.manifest() is None:
            continue
        t = training_numbers(stage.directory)
        label = "Pre-training (MuonClip)" if name == "pretrain" else "SFT (MuonClip, assistant-token loss)"
        unit = "nats/token" if name == "pretrain" else "nats/assistant token"
        lines += [f"### {label}", "",
                  f"- steps {_fmt(t['steps'])}, tokens seen {_fmt(t['tokens_seen'])}",
                  f"- final train loss {_fmt(t['loss'])}, validation loss {_fmt(t['val_loss'])} {unit}, "
                  f"unigram baseline {_fmt(t['unigram_val_loss'])}",
                  f"- largest max attention logit {_fmt(t['max_logit'], 2)} (QK-Clip tau from the stage config)"]
        if name == "sft" and (tc := toolcall_numbers(stage.directory)):
            lines.append(f"- well-formed K2 tool calls on held-out prompts: before "
                         f"{_fmt(tc.get('before_well_formed'))}/{_fmt(tc.get('before_prompts'))}, after "
                         f"{_fmt(tc.get('after_well_formed'))}/{_fmt(tc.get('after_prompts'))}")
        pngs = [stage.directory / p for p in ("loss.png", "max_logit.png")]
        if not all(p.is_file() for p in pngs):
            plot_run(stage.directory)
        lines += [""] + [f"![{name} {p.stem}]({_rel(out, p)})" for p in pngs if p.is_file()] + [""]
    rl = by_name["rl"]
    if rl.manifest() is not None:
        r = rl_numbers(rl.directory)
        lines += ["### RL (K1.5 loss, partial rollout)", "",
                  f"- {_fmt(r['iterations'])} iterations from the SFT checkpoint",
                  f"- held-out reward, greedy: {_fmt(r['eval_reward_first'])} (iteration "
                  f"{_fmt(r['eval_first_step'])}) -> {_fmt(r['eval_reward_last'])} (iteration "
                  f"{_fmt(r['eval_last_step'])})",
                  f"- held-out reward, sampled at T=1: {_fmt(r['eval_sampled_first'])} -> "
                  f"{_fmt(r['eval_sampled_last'])}",
                  f"- rollout reward, mean of the first / last {r['window']} iterations: "
                  f"{_fmt(r['train_reward_first'])} -> {_fmt(r['train_reward_last'])}"]
        curves = rl.directory / CURVES_FILE
        if not curves.is_file():
            plot_rl_curves(rl.directory)
        if curves.is_file():
            lines += ["", f"![rl curves]({_rel(out, curves)})"]
        lines.append("")
    return lines


def _eval_section(out: Path, stages: list[Stage]) -> list[str]:
    evals = [(s.name.removeprefix("eval-"), eval_results(s.directory)) for s in stages
             if s.name.startswith("eval-") and s.manifest() is not None]
    if not evals:
        return []
    benchmarks = list(dict.fromkeys(b for _, res in evals for b in res))
    lines = ["## Evaluation across stages", "",
             "Value with its 95% interval and sample count, per benchmark (rows) and checkpoint (columns).", "",
             "| benchmark | metric | " + " | ".join(f"after {name}" for name, _ in evals) + " |",
             "|---|---|" + "---|" * len(evals)]
    for bench in benchmarks:
        metric = next((res[bench].get("metric", "") for _, res in evals if bench in res), "")
        cells = []
        for _, res in evals:
            v = res.get(bench)
            cells.append("-" if v is None else
                         f"{_fmt(v.get('value'))} [{_fmt(v.get('low'))}, {_fmt(v.get('high'))}] (n={v.get('n')})")
        lines.append(f"| {bench} | {metric} | " + " | ".join(cells) + " |")
    plot = plot_eval_stages(evals, out / EVAL_PLOT)
    if plot is not None:
        lines += ["", f"![evaluation across stages]({_rel(out, plot)})"]
    return lines + [""]


def plot_eval_stages(evals: list[tuple[str, dict[str, dict[str, Any]]]], path: Path) -> Path | None:
    """One panel per benchmark, one bar per stage, with the 95% interval as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benchmarks = list(dict.fromkeys(b for _, res in evals for b in res))
    if not benchmarks:
        return None
    fig, axes = plt.subplots(1, len(benchmarks), figsize=(3.2 * len(benchmarks), 3.4), squeeze=False)
    for ax, bench in zip(axes[0], benchmarks, strict=True):
        names, values, errors = [], [], [[], []]
        for name, res in evals:
            v = res.get(bench, {})
            value = v.get("value")
            value = value if isinstance(value, int | float) and math.isfinite(value) else float("nan")
            low, high = v.get("low", value), v.get("high", value)
            names.append(name)
            values.append(value)
            errors[0].append(max(0.0, value - low) if math.isfinite(value) and _finite(low) else 0.0)
            errors[1].append(max(0.0, high - value) if math.isfinite(value) and _finite(high) else 0.0)
        ax.bar(names, values, yerr=errors, capsize=4, color=["#8da0cb", "#66c2a5", "#fc8d62"][: len(names)])
        shown = [v for v in values if math.isfinite(v)]
        if shown and min(shown) > 0 and max(shown) / min(shown) > 10:  # e.g. perplexity before and after SFT
            ax.set_yscale("log")
        metric = next((res[bench].get("metric", "") for _, res in evals if bench in res), "")
        ax.set(title=bench, ylabel=metric)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


__all__ = ["REPORT_FILE", "eval_results", "plot_eval_stages", "rl_numbers", "training_numbers", "write_report"]
