"""Multi-turn tool episodes in the RL loop: one engine drives many `Episode`s, turn by turn, for training
groups and for held-out evaluation.

Every episode is its own engine request per turn: when a turn finishes, its calls run at once and the next
turn is queued while the other episodes keep decoding (continuous batching; the prefix cache reuses the
conversation's earlier blocks). Seeds derive from (run seed, iteration, group, sample, turn), so a run is
reproducible.

Tool groups never pause: all their episodes finish within the iteration that started them (a turn is bounded
by the episode's policy-token budget and the context), so checkpoints hold no tool episode in flight and
resume needs nothing new. Under `rollout.placement = "ray"` the rollout workers play them: a worker rebuilds each
environment's `ToolRollout` from `spec()` (the task's registry name and the budgets) with its own tokenizer,
and builds every episode's world from its problem, so nothing of the trainer's process is needed there.
With `record_routing` every turn's engine request records its experts, and the episode keeps those of every
position (rl/routing_replay.py), so R3 replays tool groups as it does single turns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from openk2.chat import ChatFormat
from openk2.infer.engine import Engine
from openk2.infer.sampling import SamplingParams
from openk2.rl import tasks
from openk2.rl.rollout import Group
from openk2.rl.routing_replay import share_cached_rows
from openk2.rl.tasks import Problem
from openk2.rl.tasks.tool_task import ToolTask
from openk2.rl.tool_episode import Episode

_SEED_MOD = 2**62


def run_episodes(model: torch.nn.Module, tokenizer, episodes: Sequence[Episode], seeds: Sequence[int], *,
                 temperature: float, max_batch_size: int, version: int = 0, record_routing: bool = False) -> int:
    """Run every episode to its end on one engine (seed `seeds[i]` for episode i; `record_routing`: keep every
    position's experts in the trajectories, for R3); returns tokens sampled."""
    if not episodes:
        return 0
    max_seq_len = max(ep.max_context for ep in episodes)
    engine = Engine(model, tokenizer, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                    record_routing=record_routing)
    stop_ids = [episodes[0].fmt.end_of_turn_id]
    sampled = 0

    def submit(i: int) -> None:
        ep = episodes[i]
        room = ep.room()
        if room == 0:
            ep.end("length")
            return
        seed = hash((seeds[i], ep.traj.turns)) % _SEED_MOD
        params = SamplingParams(max_tokens=room, temperature=temperature, seed=seed, stop_token_ids=stop_ids)
        engine.add_request(ep.context_ids, params, request_id=f"{i}:{ep.traj.turns}")

    for i in range(len(episodes)):
        submit(i)
    while engine.has_unfinished():
        for result in engine.step():
            i = int(str(result.request_id).split(":")[0])
            sampled += len(result.token_ids)
            if not episodes[i].advance(result, version):
                submit(i)
    if record_routing:  # a sample's prompt blocks read from an earlier sample's cache: that one's experts
        share_cached_rows([ep.traj for ep in episodes])
    return sampled


class ToolRollout:
    """A tool environment's episodes: its task, format, budgets, and the engine settings."""

    def __init__(self, task: ToolTask, tokenizer, *, max_tokens: int, max_turns: int, max_context: int,
                 max_batch_size: int, seed: int = 0, record_routing: bool = False, task_name: str = "") -> None:
        if max_turns < 1 or max_tokens < 1:
            raise ValueError(f"a tool environment needs max_turns >= 1 and max_tokens >= 1, got {max_turns}, "
                             f"{max_tokens}")
        self.task, self.tokenizer, self.fmt = task, tokenizer, ChatFormat(tokenizer)
        self.max_tokens, self.max_turns, self.max_context = max_tokens, max_turns, max_context
        self.max_batch_size, self.seed, self.record_routing = max_batch_size, seed, record_routing
        self.task_name = task_name or task.name  # its name in the task registry (openk2.rl.tasks.get)

    def spec(self) -> dict[str, Any]:
        """What a rollout worker rebuilds this environment from (`from_spec`): plain values only."""
        return {"task": self.task_name, "max_tokens": self.max_tokens, "max_turns": self.max_turns,
                "max_context": self.max_context, "max_batch_size": self.max_batch_size, "seed": self.seed,
                "record_routing": self.record_routing}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any], tokenizer) -> ToolRollout:
        """The environment `spec()` describes, its task built from the registry, on `tokenizer`."""
        task = tasks.get(spec["task"])
        if not isinstance(task, ToolTask):
            raise ValueError(f"task {spec['task']!r} is not a ToolTask: it has no multi-turn episodes")
        return cls(task, tokenizer, **{k: v for k, v in spec.items() if k != "task"}, task_name=spec["task"])

    def episode(self, problem: Problem) -> Episode:
        """A fresh episode of `problem` with this environment's budgets."""
        return Episode(self.task, problem, self.fmt, self.max_tokens, self.max_context, self.max_turns)

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The episode's first prompt: the tools declared, the question, the open assistant turn."""
        return self.fmt.prepare([{"role": "user", "content": problem.prompt}], self.task.tools()).token_ids

    def run(self, model: torch.nn.Module, groups: Sequence[Group], *, iteration: int, version: int,
            temperature: float) -> int:
        """Play every sample of `groups` to its end, replacing their trajectories; returns tokens sampled."""
        episodes, seeds = [], []
        for g in groups:
            for s in range(len(g.trajectories)):
                episodes.append(self.episode(g.problem))
                seeds.append(hash((self.seed, iteration, g.group_id, s)))
        sampled = run_episodes(model, self.tokenizer, episodes, seeds, temperature=temperature,
                               max_batch_size=self.max_batch_size, version=version,
                               record_routing=self.record_routing)
        it = iter(episodes)
        for g in groups:
            g.trajectories = [next(it).traj for _ in g.trajectories]
        return sampled

    def evaluate(self, model: torch.nn.Module, problems: Sequence[Problem], *, temperature: float,
                 seed: int) -> tuple[list[float], list[int]]:
        """Rewards and policy-token lengths of one episode per held-out problem (the same seeds every call)."""
        episodes = [self.episode(p) for p in problems]
        run_episodes(model, self.tokenizer, episodes, [hash((seed, j)) for j in range(len(episodes))],
                     temperature=temperature, max_batch_size=self.max_batch_size)
        return [ep.traj.reward for ep in episodes], [ep.traj.num_sampled for ep in episodes]


def attach_tool_rollouts(envs: Sequence, tokenizer, *, max_context: int, max_batch_size: int, seed: int,
                         record_routing: bool = False) -> dict[str, ToolRollout]:
    """Give every mixture environment whose task is a ToolTask its `ToolRollout` (`env.tools`; `record_routing`:
    its training episodes keep their experts for R3); returns them by environment name."""
    for env in envs:
        if not isinstance(env.task, ToolTask):
            continue
        env.tools = ToolRollout(env.task, tokenizer, max_tokens=env.max_tokens,
                                max_turns=env.spec.max_turns or env.task.max_turns, max_context=max_context,
                                max_batch_size=max_batch_size, seed=seed, record_routing=record_routing,
                                task_name=env.spec.task_name)
    return {env.name: env.tools for env in envs if env.tools is not None}


def run_tool_groups(tools: Mapping[str, ToolRollout], groups: Sequence[Group], model: torch.nn.Module, *,
                    iteration: int, version: int, temperature: float) -> int:
    """Play the tool groups of one iteration (`tools`: environment name -> its ToolRollout), each environment's
    on its own engine; returns tokens sampled."""
    sampled = 0
    for name in sorted({g.env for g in groups}):
        sampled += tools[name].run(model, [g for g in groups if g.env == name], iteration=iteration,
                                   version=version, temperature=temperature)
    return sampled


def tool_metrics(groups: Sequence[Group], env: str) -> dict[str, float]:
    """`tool_calls/<env>` (per episode), `malformed_rate/<env>` (of the calls made), `turns/<env>` and
    `answered/<env>` (episodes that ended with a final answer) over `groups` of environment `env`."""
    trajs = [t for g in groups if g.env == env for t in g.trajectories]
    if not trajs:
        return {}
    calls = sum(t.tool_calls for t in trajs)
    return {f"tool_calls/{env}": float(np.mean([t.tool_calls for t in trajs])),
            f"malformed_rate/{env}": sum(t.malformed_calls for t in trajs) / calls if calls else float("nan"),
            f"turns/{env}": float(np.mean([t.turns for t in trajs])),
            f"answered/{env}": float(np.mean([t.finish_reason == "stop" for t in trajs]))}


__all__ = ["ToolRollout", "attach_tool_rollouts", "run_episodes", "run_tool_groups", "tool_metrics"]
