"""The supervised warm-up of a mixture with tool environments: worked tool-use transcripts next to the
arithmetic worked solutions, so the tiny policy's BPE and weights know the K2 tool-call format before RL.

A tool task's example is its `transcript` (the question, the assistant's calls, the tool results, the answer)
rendered by the chat template with the tools declared, exactly as a rollout prompt is; only the assistant's
turns are trained on (`render_with_mask`). Each example's environment is drawn by the mixture's weights.

With `warmup.probe_problems > 0` the warm-up stops early, at the first probe check whose greedy success reaches
the band `[probe_low, probe_high]` (rl/tool_probe.py); the checks and the chosen step go to `warmup/probe.json`
and stderr.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from openk2.chat.template import IM_END, render_with_mask
from openk2.data.tokenizer import K2Tokenizer
from openk2.model import K2ForCausalLM
from openk2.rl.config import RLConfig
from openk2.rl.mixture import MixtureEnv, problems
from openk2.rl.tasks import Problem, Task
from openk2.rl.tasks.tool_task import ToolTask
from openk2.rl.tool_probe import PROBE_FILE, ProbeStop, exclude_probes
from openk2.rl.tool_rollout import ToolRollout
from openk2.rl.warmup import WARMUP_DIR, Example, StopRule, run_warmup, sft_example


def tool_example(task: ToolTask, problem: Problem) -> Example:
    """A worked tool-use episode as (text, trained on) runs: the assistant's turns (each closed by its
    `<|im_end|>`, the rollout's stop token) are the targets."""
    return [*render_with_mask(task.transcript(problem), task.tools(), add_generation_prompt=False), (IM_END, True)]


def mixed_stream(envs: Sequence[MixtureEnv], seed: int) -> Iterator[Problem]:
    """Warm-up problems of every environment, each drawn by weight, held-out prompts skipped."""
    rng = random.Random(seed)
    streams = [problems(e.task, e.spec.difficulties, seed + 1 + i, e.exclude) for i, e in enumerate(envs)]
    weights = [e.spec.weight for e in envs]
    while True:
        yield next(rng.choices(streams, weights=weights)[0])


def run_tool_warmup(cfg: RLConfig, envs: Sequence[MixtureEnv], out_dir: Path) -> tuple[K2ForCausalLM, K2Tokenizer]:
    """The warmed-up policy and tokenizer for a mixture of tool tasks and arithmetic (others have no worked
    solutions: start such a mixture from `[model] checkpoint`)."""
    by_name: dict[str, Task] = {}
    for env in envs:
        if not isinstance(env.task, ToolTask) and env.task.name != "arithmetic":
            raise ValueError(f"the warm-up writes worked solutions for arithmetic and tool tasks only, not "
                             f"{env.task.name!r}; start this mixture from [model] checkpoint = <an SFT policy>")
        by_name[env.task.name] = env.task

    def example(problem: Problem) -> Example:
        task = by_name[problem.task]
        return tool_example(task, problem) if isinstance(task, ToolTask) else sft_example(problem)

    probes = exclude_probes(envs, cfg.warmup.probe_problems, cfg.train.seed)  # before the stream skips them
    stream = mixed_stream(envs, cfg.train.seed + 1)
    wc = cfg.warmup
    rule = ProbeStop(wc.probe_every, wc.probe_low, wc.probe_high, wc.steps) if probes else None
    stop = probe_stop(cfg, envs, probes, rule) if rule is not None else None
    model, tokenizer = run_warmup(cfg, envs[0].task, out_dir, set(), stream=stream, example=example, stop=stop)
    if rule is not None and rule.trace:  # a fresh warm-up (a reused one keeps its own probe.json)
        summary = rule.summary()
        (out_dir / WARMUP_DIR / PROBE_FILE).write_text(json.dumps(summary, indent=1))
        print(f"warm-up: stopped after {summary['steps']} steps, probe greedy success "
              f"{rule.trace[-1][1]:.3f} ({summary['band']} the band [{wc.probe_low}, {wc.probe_high}])",
              file=sys.stderr)
    return model, tokenizer


def probe_score(model: K2ForCausalLM, tokenizer: K2Tokenizer, envs: Sequence[MixtureEnv],
                probes: dict[str, list[Problem]], cfg: RLConfig) -> float:
    """Greedy episode success over every tool environment's probe problems (the model back in train mode)."""
    model.eval()
    rewards: list[float] = []
    for env in envs:
        if env.name not in probes:
            continue
        rollout = ToolRollout(env.task, tokenizer, max_tokens=env.max_tokens,
                              max_turns=env.spec.max_turns or env.task.max_turns,
                              max_context=cfg.model.max_position_embeddings, max_batch_size=cfg.rollout.max_batch_size)
        rewards += rollout.evaluate(model, probes[env.name], temperature=0.0, seed=cfg.train.seed)[0]
    model.train()
    return float(np.mean(rewards))


def probe_stop(cfg: RLConfig, envs: Sequence[MixtureEnv], probes: dict[str, list[Problem]],
               rule: ProbeStop) -> StopRule:
    """The warm-up's stop callback: at every due step, score the probes and ask `rule`."""

    def stop(step: int, model: K2ForCausalLM, tokenizer: K2Tokenizer) -> bool:
        if not rule.due(step):
            return False
        score = probe_score(model, tokenizer, envs, probes, cfg)
        print(f"warm-up probe: step {step}, greedy success {score:.3f}", file=sys.stderr, flush=True)
        return rule.check(step, score)

    return stop


__all__ = ["mixed_stream", "probe_score", "probe_stop", "run_tool_warmup", "tool_example"]
