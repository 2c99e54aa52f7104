"""Re-decode the critic of `openk2 rl` runs on their held-out comparisons and split its accuracy into two parts.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/critic_decode_eval.py \\
        --arm trained RUN_S0 RUN_S1 RUN_S2 --arm control CTL_S0 CTL_S1 CTL_S2 [--steps 0 30] [--json OUT]

Each run directory is one seed of a config with a `task = "critic"` environment (configs/rl-critic-tiny.toml,
or its control configs/rl-critic-control-tiny.toml). Its fixed held-out comparisons are read from the newest
checkpoint's rl_state.json; the policy of step 0 is the run's warm-up, that of step N its checkpoint step-N.
Every policy answers every comparison greedily, decoded as the trainer's `critic_accuracy` evaluation decodes
it (`critic_env.generate_texts`, the run's batch size), so the accuracy printed next to the logged one must
equal it. Per policy:

- accuracy: the verdict prefers the better-verified response (no verdict scores 0);
- named: the share of replies that name a response (a letter, or the final answer of exactly one of the two);
- among named: accuracy over the replies that name one (0.5 for a coin or a position-biased critic);
- A share: the share of named verdicts that say A (each pair appears in both orders, so 0.5 is unbiased).

The actor's held-out reward at those steps (`eval_reward`, `eval_reward_sampled`: greedy and sampled, as the run
logged them) is summarised the same way.

Across seeds (runs are paired by their position after `--arm`): each arm's mean at the first and last step
and the paired rise, with Student-t 95% intervals (df = seeds - 1); with two arms, the first arm's rise minus
the second's, paired by seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from openk2.chat import ChatFormat
from openk2.data.tokenizer import K2Tokenizer
from openk2.experiments.seeds import mean_ci
from openk2.model import K2ForCausalLM
from openk2.rl.critic_compact import COMPACT_FORMAT, compact_verdict
from openk2.rl.critic_env import generate_texts
from openk2.rl.critic_loop import CriticRefinementTask
from openk2.rl.tasks import Problem
from openk2.train.metrics import read_metrics

METRICS = ("accuracy", "named", "among_named", "a_share")
LOGGED = ("eval_reward", "eval_reward_sampled")  # the actor's held-out reward (the critic env is not in it), as logged


def held_out_comparisons(run: Path, env: str = "critic") -> list[Problem]:
    """The run's fixed held-out comparisons, from its newest checkpoint."""
    checkpoints = sorted((run / "checkpoints").glob("step-*"))
    if not checkpoints:
        raise ValueError(f"{run} has no checkpoints/step-* to read the held-out comparisons from")
    state = json.loads((checkpoints[-1] / "rl_state.json").read_text())
    return [Problem(**p) for p in state["critic"]["held_out"][env]]


def policy_dir(run: Path, step: int) -> Path:
    """Step 0: the run's warm-up; step N: its checkpoint step-N."""
    path = run / "warmup" if step == 0 else run / "checkpoints" / f"step-{step:07d}"
    if not (path / "config.json").is_file():
        raise ValueError(f"{run} has no policy for step {step} (looked in {path})")
    return path


def score_policy(path: Path, problems: list[Problem], max_tokens: int, max_batch_size: int) -> dict[str, float]:
    """The four metrics of one policy's greedy verdicts on `problems` (see the module docstring)."""
    model = K2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = K2Tokenizer.load(path)
    stop = ChatFormat(tokenizer).end_of_turn_id
    replies = generate_texts(model, tokenizer, stop, [[{"role": "user", "content": p.prompt}] for p in problems],
                             max_tokens=max_tokens, max_batch_size=max_batch_size)
    task = CriticRefinementTask(fmt=COMPACT_FORMAT)
    scores = [task.verify(p, r) for p, r in zip(problems, replies, strict=True)]
    verdicts = [compact_verdict(r, *p.data["responses"]) for p, r in zip(problems, replies, strict=True)]
    named = [(s, v) for s, v in zip(scores, verdicts, strict=True) if v is not None]
    nan = float("nan")
    return {"accuracy": sum(scores) / len(scores), "named": len(named) / len(scores),
            "among_named": sum(s for s, _ in named) / len(named) if named else nan,
            "a_share": sum(v == "A" for _, v in named) / len(named) if named else nan,
            "comparisons": len(scores)}


def score_run(run: Path, steps: list[int]) -> dict[int, dict[str, float]]:
    """Each step's metrics for one run, with the accuracy its metrics.jsonl logged at that step."""
    cfg = json.loads((run / "rl_config.json").read_text())
    critic = next(e for e in cfg["envs"] if e["task"] == "critic")
    problems = held_out_comparisons(run, critic["name"])
    evals = {r["step"]: r for r in read_metrics(run) if "critic_accuracy" in r}
    logged = {step: r["critic_accuracy"] for step, r in evals.items()}
    out = {}
    for step in steps:
        out[step] = score_policy(policy_dir(run, step), problems, critic["max_tokens"] or 32,
                                 cfg["rollout"]["max_batch_size"])
        out[step]["logged"] = logged.get(step, float("nan"))
        out[step].update({key: evals.get(step, {}).get(key, float("nan")) for key in LOGGED})
        print(f"{run.name} step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in out[step].items()), flush=True)
    return out


def interval(values: list[float], signed: bool = True) -> str:
    """`mean (low to high)`, the Student-t 95% interval over seeds."""
    mean, half = mean_ci(values)
    sign = "+" if signed else ""
    return f"{mean:{sign}.3f} ({mean - half:{sign}.3f} to {mean + half:{sign}.3f})"


def summarise(arms: dict[str, list[dict[int, dict[str, float]]]], first: int, last: int) -> list[str]:
    """Lines: per arm and metric, start and end means, the paired rise; the difference of two arms' rises."""
    lines, rises = [], {}
    for arm, runs in arms.items():
        for metric in METRICS + LOGGED:
            start = [r[first][metric] for r in runs]
            end = [r[last][metric] for r in runs]
            rise = [b - a for a, b in zip(start, end, strict=True)]
            rises[arm, metric] = rise
            lines.append(f"{arm} {metric}: {first} -> {last}: {interval(start, False)} -> {interval(end, False)}; "
                         f"rise {interval(rise)}")
    if len(arms) == 2:
        a, b = arms
        for metric in METRICS + LOGGED:
            diff = [x - y for x, y in zip(rises[a, metric], rises[b, metric], strict=True)]
            lines.append(f"{a} minus {b}, rise of {metric}: {interval(diff)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", nargs="+", action="append", required=True, metavar=("NAME", "RUN"),
                        help="an arm's name, then its run directories in seed order")
    parser.add_argument("--steps", nargs="+", type=int, default=[0, 30])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    arms: dict[str, list[dict[int, dict[str, float]]]] = {}
    for name, *runs in args.arm:
        if not runs:
            raise ValueError(f"--arm {name} names no run directory")
        arms[name] = [score_run(Path(r), args.steps) for r in runs]
    if len({len(r) for r in arms.values()}) > 1:
        raise ValueError("the arms are paired by seed: give each the same number of runs")
    lines = summarise(arms, args.steps[0], args.steps[-1])
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"arms": {a: [{str(k): v for k, v in r.items()} for r in runs]
                                                  for a, runs in arms.items()}, "summary": lines}, indent=2))


if __name__ == "__main__":
    main()
