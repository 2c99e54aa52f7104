"""Paired re-scoring of tool-environment RL runs: each run's warm-up policy and its last checkpoint play the same
held-out shops with the trainer's own evaluation seeds (docs/rl.md, "Multi-turn tool environments").

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rl_tool_paired_eval.py RUN_DIR [RUN_DIR ...] [--json OUT]

For every run: the config is read back from `RUN_DIR/rl_config.json`, the held-out problems are rebuilt from it
(`build_mixture`), and `RUN_DIR/warmup` (step 0) and the newest `RUN_DIR/checkpoints/step-*` each play one greedy
episode per held-out problem (seed train.seed) and `task.eval_samples` episodes at T = 1 (seeds train.seed + i),
exactly as `RLTrainer.evaluate` does, so the means reproduce the logged step-0 and last `eval_reward/...`.
Each problem's score difference is one paired observation: the per-run interval is the paired t-interval over
problems; across runs, the interval is the Student-t interval over the runs' mean gains (df = runs - 1).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from openk2.data.tokenizer import K2Tokenizer
from openk2.experiments.seeds import mean_ci, t_quantile
from openk2.model import K2ForCausalLM
from openk2.rl.config import RLConfig
from openk2.rl.mixture import build_mixture
from openk2.rl.tasks.tool_task import ToolTask
from openk2.rl.tool_rollout import ToolRollout


def per_problem_scores(policy_dir: Path, cfg: RLConfig) -> dict[str, list[float]]:
    """Each held-out tool problem's greedy reward and mean reward over the evaluation's T = 1 samples."""
    model = K2ForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    tokenizer = K2Tokenizer.load(policy_dir)
    seed = cfg.train.seed
    greedy: list[float] = []
    sampled: list[float] = []
    for env in build_mixture(cfg, seed):
        if not isinstance(env.task, ToolTask):
            continue
        rollout = ToolRollout(env.task, tokenizer, max_tokens=env.max_tokens,
                              max_turns=env.spec.max_turns or env.task.max_turns,
                              max_context=model.config.max_position_embeddings,
                              max_batch_size=cfg.rollout.max_batch_size, seed=seed)
        greedy += rollout.evaluate(model, env.eval_problems, temperature=0.0, seed=seed)[0]
        passes = [rollout.evaluate(model, env.eval_problems, temperature=1.0, seed=seed + i)[0]
                  for i in range(cfg.task.eval_samples)]
        sampled += [statistics.fmean(values) for values in zip(*passes, strict=True)]
    if not greedy:
        raise ValueError(f"the run's mixture has no tool environment ({policy_dir})")
    return {"greedy": greedy, "sampled": sampled}


def paired(before: list[float], after: list[float]) -> dict[str, float]:
    """Means, the mean paired gain, its standard error and 95% t half-width over problems."""
    diffs = [b - a for a, b in zip(before, after, strict=True)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {"before": statistics.fmean(before), "after": statistics.fmean(after), "gain": statistics.fmean(diffs),
            "se": se, "ci95": t_quantile(len(diffs) - 1) * se}


def last_checkpoint(run: Path) -> Path:
    """The newest complete `checkpoints/step-*` directory of a run."""
    steps = sorted(p for p in (run / "checkpoints").glob("step-*") if (p / "config.json").is_file())
    if not steps:
        raise ValueError(f"{run} has no checkpoint to compare with its warm-up")
    return steps[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="write every run's numbers here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for run in args.runs:
        cfg = RLConfig.from_dict(json.loads((run / "rl_config.json").read_text()))
        after = last_checkpoint(run)
        before_scores, after_scores = per_problem_scores(run / "warmup", cfg), per_problem_scores(after, cfg)
        results[str(run)] = {"seed": cfg.train.seed, "checkpoint": after.name,
                             **{mode: paired(before_scores[mode], after_scores[mode]) for mode in before_scores}}
        for mode in before_scores:
            r = results[str(run)][mode]
            print(f"{run} seed {cfg.train.seed} {mode}: {r['before']:.4f} -> {r['after']:.4f} ({after.name}), "
                  f"paired gain {r['gain']:+.4f} (SE {r['se']:.4f}, 95% {r['gain'] - r['ci95']:+.4f} to "
                  f"{r['gain'] + r['ci95']:+.4f}, {r['gain'] / r['se'] if r['se'] else math.inf:.1f} SE)", flush=True)
    if len(results) > 1:
        for mode in ("greedy", "sampled"):
            for key in ("before", "after", "gain"):
                mean, half = mean_ci([r[mode][key] for r in results.values()])
                print(f"over {len(results)} runs, {mode} {key}: {mean:+.4f} +- {half:.4f} (95%, df {len(results) - 1})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
