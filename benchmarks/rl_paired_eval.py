"""Paired re-scoring of RL checkpoints against their start policy on the same held-out arithmetic problems.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rl_paired_eval.py BEFORE_CKPT [AFTER_CKPT ...] \\
        [--seed S] [--count N] [--difficulties 3] [--json OUT]

Every checkpoint answers the same problems: the first N held-out problems of the held-out seed S (the RL run's
`task.eval_seed`, else its `train.seed`; the pipeline's SFT data excludes seed 0's), greedily and with 8
samples at temperature 1 (sampling seeds 1-8, the same for every checkpoint). Each problem's score difference
is one paired observation, so a run's interval is the paired standard error over problems: the noise of the
problem draw cancels between the two. With several AFTER checkpoints (RL seeds from one start), the gains are
also summarised across runs: their mean and the Student-t 95% interval over runs (df = runs - 1). With none,
only BEFORE is scored (to see where a start policy stands).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from openk2.chat import ChatFormat
from openk2.data.tokenizer import K2Tokenizer
from openk2.experiments.seeds import mean_ci
from openk2.infer.engine import Engine
from openk2.infer.sampling import SamplingParams
from openk2.model import K2ForCausalLM
from openk2.rl import tasks
from openk2.rl.mixture import held_out_problems
from openk2.rl.warmup import encode_prompt

MODES = (("greedy", 0.0, (0,)), ("sampled", 1.0, tuple(range(1, 9))))


def per_problem_scores(checkpoint: str, problems: list, task) -> dict[str, list[float]]:
    """Each problem's mean verified reward under greedy decoding and under 8 seeded samples."""
    model = K2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = K2Tokenizer.load(checkpoint)
    end = ChatFormat(tokenizer).end_of_turn_id
    prompts = [encode_prompt(tokenizer, p) for p in problems]
    engine = Engine(model, tokenizer, max_batch_size=128, max_seq_len=max(map(len, prompts)) + 32)
    scores: dict[str, list[float]] = {}
    for mode, temperature, seeds in MODES:
        totals = [0.0] * len(problems)
        for seed in seeds:
            params = SamplingParams(max_tokens=32, temperature=temperature, seed=seed, stop_token_ids=[end])
            for i, (problem, result) in enumerate(zip(problems, engine.generate(prompts, params), strict=True)):
                ids = result.token_ids[:-1] if result.token_ids and result.token_ids[-1] == end else result.token_ids
                totals[i] += task.verify(problem, tokenizer.decode(ids))
        scores[mode] = [t / len(seeds) for t in totals]
    return scores


def paired_summary(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean paired difference and its standard error, in percentage points."""
    diffs = [b - a for a, b in zip(before, after, strict=True)]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return 100 * mean, 100 * math.sqrt(var / len(diffs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after", nargs="*")
    parser.add_argument("--seed", type=int, default=0, help="held-out seed: the run's task.eval_seed, else train.seed")
    parser.add_argument("--count", type=int, default=100, help="held-out problems to score")
    parser.add_argument("--difficulties", type=int, nargs="+", default=[3], help="the levels the RL run trains")
    parser.add_argument("--json", type=Path, help="write every checkpoint's means and gains here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = tasks.get("arithmetic")
    problems = held_out_problems(task, args.difficulties, args.count, args.seed)
    before = per_problem_scores(args.before, problems, task)
    record: dict = {"before": {"checkpoint": args.before, **{m: statistics.fmean(before[m]) for m, _, _ in MODES}},
                    "after": []}
    for mode, _, _ in MODES:
        print(f"{args.before} {mode}: {statistics.fmean(before[mode]):.3f}", flush=True)
    for checkpoint in args.after:
        after = per_problem_scores(checkpoint, problems, task)
        row: dict = {"checkpoint": checkpoint}
        for mode, _, _ in MODES:
            gain, se = paired_summary(before[mode], after[mode])
            a, b = statistics.fmean(before[mode]), statistics.fmean(after[mode])
            row[mode] = {"after": b, "gain_points": gain, "se_points": se}
            print(f"{checkpoint} {mode}: {a:.3f} -> {b:.3f}, paired {gain:+.1f} +- {se:.1f} points (SE), "
                  f"95% {gain - 1.96 * se:+.1f} to {gain + 1.96 * se:+.1f}", flush=True)
        record["after"].append(row)
    if len(args.after) > 1:
        record["across_runs"] = {}
        for mode, _, _ in MODES:
            mean, half = mean_ci([r[mode]["gain_points"] for r in record["after"]])
            record["across_runs"][mode] = {"gain_points": mean, "ci95_points": half, "runs": len(args.after)}
            print(f"over {len(args.after)} runs, {mode} gain: {mean:+.1f} points, 95% t-interval "
                  f"{mean - half:+.1f} to {mean + half:+.1f} (df {len(args.after) - 1})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
