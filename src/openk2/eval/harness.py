"""Run benchmarks on a model and write what happened: `run_eval` and `compare`.

Layout of an evaluation directory:

    OUT/<benchmark>/samples.jsonl   one record per sample: id, score, answer, detail, model, seed
    OUT/results.json                {benchmark: {metric, value, low, high, n, higher_is_better}} + run settings
    OUT/summary.md                  the same as a markdown table

Each record is appended (and flushed) as soon as its sample is scored, so an interrupted run loses at most the
samples in flight; rerunning the same command scores only what is missing. Records written under other settings
(model, seed, temperature, ...) are never mixed in: the run refuses to resume over them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Any

from openk2.eval import registry
from openk2.eval.base import Aggregate, Benchmark, EvalContext, Sample, Verdict
from openk2.eval.records import claim_directory, drop_partial_line, read_records
from openk2.eval.transport import TransportGuard, is_transport_error
from openk2.fileio import atomic_write_text
from openk2.llm.base import ChatModel
from openk2.progress import progress_bar

ORACLE = "oracle"
_UNREACHABLE_LIMIT = 3  # transport failures, with nothing scored yet, before a benchmark stops trying


def run_eval(model: str | ChatModel, benchmarks: Sequence[str | Benchmark], out_dir: str | Path, *,
             limit: int | None = None,
             ctx: EvalContext | None = None, concurrency: int = 1, progress: bool = True) -> dict[str, Aggregate]:
    """Score `model` (a ChatModel, a spec for `load_chat_model`, or "oracle") on `benchmarks` (registered names or
    Benchmark objects); see the module doc."""
    if not benchmarks:
        raise ValueError("no benchmarks given")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    ctx = ctx or EvalContext()
    # unknown names fail before any model loads
    benches = [b if isinstance(b, Benchmark) else registry.get(b) for b in benchmarks]
    for bench in benches:
        bench.check(ctx)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    owned = isinstance(model, str) and model != ORACLE
    chat_model = _load_model(model) if owned else model
    model_name = ORACLE if chat_model == ORACLE else getattr(chat_model, "name", type(chat_model).__name__)
    settings = _settings(model_name, ctx, limit)
    results: dict[str, Aggregate] = {}
    try:
        for bench in benches:
            results[bench.name] = _run_benchmark(bench, chat_model, out / bench.name, settings, ctx, limit,
                                                 concurrency, progress)
    finally:
        if owned:
            chat_model.close()
    _write_results(out, benches, results, settings)
    return results


def _load_model(spec: str) -> ChatModel:
    from openk2.llm.registry import load_chat_model

    return load_chat_model(spec)


def _settings(model_name: str, ctx: EvalContext, limit: int | None) -> dict[str, Any]:
    return {"model": model_name, "seed": ctx.seed, "temperature": ctx.temperature, "max_tokens": ctx.max_tokens,
            "samples_per_problem": ctx.samples_per_problem, "k": ctx.k,
            "user_model": getattr(ctx.user_model, "name", None), "judge": getattr(ctx.judge, "name", None)}


def _run_benchmark(bench: Benchmark, model: ChatModel | str, bench_dir: Path, settings: dict, ctx: EvalContext,
                   limit: int | None, concurrency: int, progress: bool) -> Aggregate:
    bench_dir.mkdir(parents=True, exist_ok=True)
    claim_directory(bench_dir, {**settings, "benchmark": bench.settings()} if bench.settings() else settings)
    samples = bench.samples(limit)
    records_path = bench_dir / "samples.jsonl"
    drop_partial_line(records_path)
    done = {rec["id"]: rec for rec in read_records(records_path)}
    todo = [s for s in samples if s.id not in done]
    guard = TransportGuard(model) if _is_remote(model) else None
    evaluate = _evaluator(bench, guard or model, ctx)
    bar = progress_bar(len(samples), bench.name, "sample", initial=len(samples) - len(todo), enabled=progress)
    unreachable: list[BaseException] = []  # transport failures: those samples stay unrecorded
    resumed = len(done)
    finite = [r["score"] for r in done.values() if _finite(r["score"])]
    running = {"sum": sum(finite), "n": len(finite), "rates": all(0.0 <= x <= 1.0 for x in finite)}
    with open(records_path, "a", encoding="utf-8") as sink:
        def record(sample: Sample, verdict: Verdict, seconds: float, failure: BaseException | None) -> None:
            if failure is not None:
                unreachable.append(failure)
                return
            rec = {"id": sample.id, "score": verdict.score, "answer": verdict.answer, "detail": verdict.detail,
                   "model": settings["model"], "seed": ctx.sample_seed(sample.id), "seconds": round(seconds, 3)}
            sink.write(json.dumps(rec, default=str) + "\n")
            sink.flush()
            done[sample.id] = rec
            bar.update(1)
            if _finite(verdict.score):
                running["sum"] += verdict.score
                running["n"] += 1
                running["rates"] &= 0.0 <= verdict.score <= 1.0
            if running["n"] and running["rates"]:  # a running mean only where scores are rates
                bar.set_postfix(mean=f"{running['sum'] / running['n']:.3f}")

        def endpoint_down() -> bool:
            return len(unreachable) >= _UNREACHABLE_LIMIT and len(done) == resumed

        if concurrency == 1 or len(todo) <= 1:
            for sample in todo:
                if endpoint_down():
                    break
                record(sample, *evaluate(sample))
        else:
            with ThreadPoolExecutor(concurrency) as pool:
                futures = {pool.submit(evaluate, s): s for s in todo}
                for fut in as_completed(futures):
                    record(futures[fut], *fut.result())
                    if endpoint_down():
                        for other in futures:
                            other.cancel()
                        break
    bar.close()
    if unreachable:
        missing = sum(s.id not in done for s in samples)
        raise ValueError(f"{bench.name}: the model could not be reached ({type(unreachable[0]).__name__}: "
                         f"{unreachable[0]}); {missing} sample(s) left unscored, {len(samples) - missing} kept in "
                         f"{records_path}: rerun the same command to score the rest")
    wanted = [done[s.id] for s in samples]
    verdicts = [Verdict(r["score"], r.get("answer"), r.get("detail") or {}) for r in wanted]
    scored = [v for v in verdicts if _finite(v.score)]
    if len(scored) < len(verdicts):
        reasons = {str(v.detail.get("error", "no score")) for v in verdicts if not _finite(v.score)}
        print(f"{bench.name}: {len(verdicts) - len(scored)} sample(s) could not be scored: "
              f"{'; '.join(sorted(reasons))}")
    return bench.aggregate(scored) if scored else Aggregate(math.nan, math.nan, math.nan, 0)


def _is_remote(model: ChatModel | str) -> bool:
    from openk2.llm.openai_backend import OpenAIChatModel

    return isinstance(model, OpenAIChatModel)


_Outcome = tuple[Verdict, float, BaseException | None]


def _evaluator(bench: Benchmark, model: ChatModel | str, ctx: EvalContext) -> Callable[[Sample], _Outcome]:
    """Scores one sample and times it; the oracle is built per sample, and a benchmark bug becomes a
    recorded error rather than the end of the run (the record says which exception). The third element is a
    transport failure (an endpoint unreachable: the model's, or a user simulator's that a benchmark let
    through), for which the verdict means nothing."""
    def evaluate(sample: Sample) -> _Outcome:
        start = time.perf_counter()
        failure: BaseException | None = None
        try:
            if model == ORACLE:
                try:
                    chat_model = bench.oracle(sample)
                except NotImplementedError as exc:
                    return Verdict(math.nan, None, {"error": f"no oracle: {exc}"}), 0.0, None
            else:
                chat_model = model
            verdict = bench.evaluate(chat_model, sample, ctx)
        except Exception as exc:  # noqa: BLE001 - recorded per sample, see docstring
            verdict = Verdict(0.0, None, {"error": f"{type(exc).__name__}: {exc}"})
            failure = exc if is_transport_error(exc) else None
        if isinstance(model, TransportGuard):
            failure = model.take_failure() or failure
        return verdict, time.perf_counter() - start, failure
    return evaluate


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _write_results(out: Path, benches: Sequence[Benchmark], results: dict[str, Aggregate], settings: dict) -> None:
    previous = load_results(out) if (out / "results.json").exists() else {}
    # keep earlier benchmarks of this directory in the table, unless they were run under other settings
    table = dict(previous.get("benchmarks", {})) if previous.get("settings") == settings else {}
    for bench in benches:
        agg = results[bench.name]
        table[bench.name] = {"metric": bench.metric, "higher_is_better": bench.higher_is_better, **asdict(agg)}
        if bench.settings():
            table[bench.name]["settings"] = bench.settings()
    payload = {"settings": settings, "benchmarks": table}
    atomic_write_text(out / "results.json", json.dumps(payload, indent=2, default=str))
    atomic_write_text(out / "summary.md", format_table(payload, title=f"model `{settings['model']}`"))


def load_results(run_dir: str | Path) -> dict:
    """A run directory's results.json."""
    path = Path(run_dir) / "results.json"
    if not path.exists():
        raise ValueError(f"{run_dir} has no results.json (not an evaluation directory, or the run never finished)")
    return json.loads(path.read_text())


def format_table(payload: dict, title: str = "") -> str:
    """One run's results as a markdown table (score with its 95% interval, n)."""
    lines = [f"# Evaluation: {title}", ""] if title else []
    lines += ["| benchmark | metric | score | 95% interval | n |", "|---|---|---|---|---|"]
    for name, row in sorted(payload["benchmarks"].items()):
        lines.append(f"| {name} | {row['metric']} | {_fmt(row['value'])} | "
                     f"[{_fmt(row['low'])}, {_fmt(row['high'])}] | {row['n']} |")
    return "\n".join(lines) + "\n"


def compare(run_dirs: Sequence[str | Path], labels: Sequence[str] | None = None) -> str:
    """Runs side by side: one row per benchmark, one column per run, the best score in bold."""
    if not run_dirs:
        raise ValueError("compare needs at least one evaluation directory")
    runs = [load_results(d) for d in run_dirs]
    labels = list(labels) if labels else [r["settings"]["model"] for r in runs]
    if len(labels) != len(runs):
        raise ValueError("give one label per run")
    names = sorted({name for r in runs for name in r["benchmarks"]})
    lines = ["| benchmark | metric | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(runs)]
    for name in names:
        rows = [r["benchmarks"].get(name) for r in runs]
        known = [row for row in rows if row and _finite(_num(row["value"]))]
        best = None
        if known:
            pick = max if known[0]["higher_is_better"] else min
            best = pick(_num(row["value"]) for row in known)
        cells = []
        for row in rows:
            if not row:
                cells.append("-")
                continue
            text = f"{_fmt(row['value'])} ± {_fmt((_num(row['high']) - _num(row['low'])) / 2)} (n={row['n']})"
            cells.append(f"**{text}**" if len(known) > 1 and _num(row["value"]) == best else text)
        metric = next(row["metric"] for row in rows if row)
        lines.append(f"| {name} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _num(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _fmt(x: Any) -> str:
    x = _num(x)
    if not math.isfinite(x):
        return "n/a"
    return f"{x:.3f}" if abs(x) < 1000 else f"{x:.1f}"
