"""Paired re-scoring of two RL checkpoints on the same held-out arithmetic problems (docs/rl.md).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rl_paired_eval.py BEFORE_CKPT AFTER_CKPT [--seed S] [--count N]

Both checkpoints answer the run seed's first N held-out problems (level 3) greedily and with 8 samples at
temperature 1 (sampling seeds 1-8). Each problem's score difference is one paired observation, so the printed
interval is the paired standard error over problems: the noise of the problem draw cancels between the two.
"""

from __future__ import annotations

import argparse
import math

import torch

from openk2.chat import ChatFormat
from openk2.data.tokenizer import K2Tokenizer
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
    parser.add_argument("after")
    parser.add_argument("--seed", type=int, default=0, help="the run's train.seed (decides the held-out draw)")
    parser.add_argument("--count", type=int, default=100, help="held-out problems to score")
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = tasks.get("arithmetic")
    problems = held_out_problems(task, [3], args.count, args.seed)
    before, after = per_problem_scores(args.before, problems, task), per_problem_scores(args.after, problems, task)
    for mode, _, _ in MODES:
        gain, se = paired_summary(before[mode], after[mode])
        a, b = sum(before[mode]) / len(problems), sum(after[mode]) / len(problems)
        print(f"{mode}: {a:.3f} -> {b:.3f}, paired {gain:+.1f} +- {se:.1f} points (SE), "
              f"95% {gain - 1.96 * se:+.1f} to {gain + 1.96 * se:+.1f}", flush=True)


if __name__ == "__main__":
    main()
