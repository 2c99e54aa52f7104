"""The supervised warm-up of a mixture with tool environments: worked tool-use transcripts next to the
arithmetic worked solutions, so the tiny policy's BPE and weights know the K2 tool-call format before RL.

A tool task's example is its `transcript` (the question, the assistant's calls, the tool results, the answer)
rendered by the chat template with the tools declared, exactly as a rollout prompt is; only the assistant's
turns are trained on (`render_with_mask`). Each example's environment is drawn by the mixture's weights.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from openk2.chat.template import IM_END, render_with_mask
from openk2.data.tokenizer import K2Tokenizer
from openk2.model import K2ForCausalLM
from openk2.rl.config import RLConfig
from openk2.rl.mixture import MixtureEnv, problems
from openk2.rl.tasks import Problem, Task
from openk2.rl.tasks.tool_task import ToolTask
from openk2.rl.warmup import Example, run_warmup, sft_example


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

    stream = mixed_stream(envs, cfg.train.seed + 1)
    return run_warmup(cfg, envs[0].task, out_dir, set(), stream=stream, example=example)


__all__ = ["mixed_stream", "run_tool_warmup", "tool_example"]
