"""`openk2 eval`: score a model on benchmarks (`--list` names them), `openk2 eval compare DIR DIR ...`, or
`openk2 eval report DIR` (a citable report with settings and the K2 report's numbers)."""

from __future__ import annotations

import argparse
from pathlib import Path

from openk2.eval.base import EvalContext

_EPILOG = """model specs: local:CKPT_DIR | hf:smollm2 | openai:http://host:port/v1#MODEL | oracle
(oracle replays each benchmark's ground truth: a self-test of the scorers and environments)

examples:
  openk2 eval --list
  openk2 eval --model oracle --benchmarks bfcl-simple,humaneval --limit 20
  openk2 eval --model openai:http://127.0.0.1:8000/v1 --benchmarks tau2-retail --user-model hf:smollm2
  openk2 eval --model openai:http://127.0.0.1:8000/v1 --benchmarks tau2-retail --runner tau2 \
      --user-model openai:http://127.0.0.1:9000/v1#user --samples 4 --k 1
  openk2 eval compare runs/eval/before runs/eval/after --labels before,after
  openk2 eval report runs/eval/after --out report.md
"""
_TAU2_DEV = ("tau2-retail", "tau2-airline")


def eval_main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if argv[:1] == ["compare"]:
        return _compare_main(argv[1:])
    if argv[:1] == ["report"]:
        return _report_main(argv[1:])
    parser = argparse.ArgumentParser(prog="openk2 eval", description="Evaluate a model on benchmarks.",
                                     epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the benchmark names and exit")
    parser.add_argument("--model", help="the model under test (see specs below)")
    parser.add_argument("--benchmarks", help="comma-separated names, e.g. bfcl-simple,humaneval,rl:arithmetic")
    parser.add_argument("--limit", type=int, help="first N samples of each benchmark")
    parser.add_argument("--out", help="evaluation directory (default runs/eval/<model>); reruns resume it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-tokens", type=int, default=512, help="per model turn")
    parser.add_argument("--samples", type=int, default=1, help="samples per problem, for pass@k (humaneval)")
    parser.add_argument("--k", type=int, default=1, help="k of pass@k (<= --samples)")
    parser.add_argument("--user-model", help="spec of the user simulator for multi-turn benchmarks (tau2, "
                        "required there, as tau2 uses a separate user model; the --model spec again is allowed)")
    parser.add_argument("--runner", choices=["openk2", "tau2"], default="openk2",
                        help="tau2 benchmarks: openk2's own loop (fast development mode) or tau2's own runner "
                        "through litellm (leaderboard mode; endpoints only; --samples = trials, --k of pass^k)")
    parser.add_argument("--judge", help="spec of the judge where a benchmark needs one")
    parser.add_argument("--concurrency", type=int, default=1, help="samples scored at once (threads)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    if args.list:
        from openk2.eval.registry import describe

        for name, description in describe():
            print(f"{name:24s} {description}")
        print(f"{'rl:<task>[@<level>]':24s} any verifiable RL task on held-out seeds, every difficulty in turn or "
              "one (see `openk2 rl-tasks list`)")
        return 0
    if not args.model or not args.benchmarks:
        parser.error("--model and --benchmarks are required (or --list)")
    if not 1 <= args.k <= args.samples:
        raise ValueError(f"--k must be between 1 and --samples ({args.samples}), got {args.k}")
    benchmarks: list = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    if (args.model != "oracle" and not args.user_model
            and any(b.startswith("tau2-") for b in benchmarks)):
        parser.error("tau2 benchmarks need --user-model (tau2 simulates the user with a separate model; give the "
                     "--model spec again to let the model under test play the user)")
    if args.runner == "tau2":
        if args.model == "oracle":
            parser.error("--runner tau2 drives endpoints through litellm; the oracle self-test runs openk2's loop")
        from openk2.eval.tau2_runner import Tau2RunnerBenchmark

        benchmarks = [Tau2RunnerBenchmark(b.removeprefix("tau2-")) if b in _TAU2_DEV else b for b in benchmarks]
    from openk2.eval.harness import format_table, load_results, run_eval
    from openk2.llm.registry import load_chat_model

    ctx = EvalContext(seed=args.seed, temperature=args.temperature, max_tokens=args.max_tokens,
                      samples_per_problem=args.samples, k=args.k,
                      user_model=load_chat_model(args.user_model) if args.user_model else None,
                      judge=load_chat_model(args.judge) if args.judge else None)
    out = Path(args.out or Path("runs") / "eval" / _slug(args.model))
    run_eval(args.model, benchmarks, out, limit=args.limit, ctx=ctx, concurrency=args.concurrency,
             progress=not args.quiet)
    print(format_table(load_results(out)), end="")
    print(f"records: {out}/<benchmark>/samples.jsonl, table: {out}/summary.md")
    return 0


def _compare_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="openk2 eval compare", description="Evaluation runs side by side.")
    parser.add_argument("runs", nargs="+", help="evaluation directories (with results.json)")
    parser.add_argument("--labels", help="comma-separated column names (default: the models)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    from openk2.eval.harness import compare

    table = compare(args.runs, args.labels.split(",") if args.labels else None)
    print(table, end="")
    if args.out:
        Path(args.out).write_text(table)
    return 0


def _report_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="openk2 eval report", description="A citable markdown report of one run: "
                                     "scores with intervals, the settings that affect comparability, the K2 report's "
                                     "published numbers beside ours.")
    parser.add_argument("run", help="an evaluation directory (with results.json)")
    parser.add_argument("--out", help="write the report to this file (default DIR/report.md)")
    args = parser.parse_args(argv)
    from openk2.eval.report import build_report
    from openk2.fileio import atomic_write_text

    text = build_report(args.run)
    out = Path(args.out or Path(args.run) / "report.md")
    atomic_write_text(out, text)
    print(text, end="")
    print(f"report: {out}")
    return 0


def _slug(spec: str) -> str:
    """A directory name for a model spec: 'local:runs/tiny/final' -> 'local-runs-tiny-final'."""
    keep = [c if c.isalnum() or c in "._" else "-" for c in spec]
    return "".join(keep).strip("-")[:80] or "model"
