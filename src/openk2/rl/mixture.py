"""The RL loop's environment mixture (K2 report 3.2.1-3.2.2): several verifiable tasks in one loop, each with its
share of the new groups, its own response budget, its difficulty curriculum and its held-out problems.

Every new group draws its environment by weight, from a seed of its own (run seed, group id), so a resumed
run and a fresh one draw the same environments and problems; a one-environment mixture draws the same
problems as the loop did before it had a mixture. The held-out problems of an environment are excluded from
its training stream (and from the supervised warm-up's). An `eval_only` entry keeps its share of the draws, but
the groups drawn for it are not started: the other environments get the same problems as when it trains, and it
is evaluated without being trained on (the critic's control run, docs/rl.md).

An entry whose task is a `ToolTask` (e.g. `lookup`) is a multi-turn tool environment: the trainer gives it a
`ToolRollout` (`MixtureEnv.tools`), which plays its groups as episodes with executed tool calls instead of
`PartialRollout`'s single turns (openk2.rl.tool_rollout; docs/rl.md, "Multi-turn tool environments").
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from openk2.rl import tasks
from openk2.rl.config import EnvSection, RLConfig
from openk2.rl.tasks import Problem, Task

if TYPE_CHECKING:
    from openk2.rl.tool_rollout import ToolRollout


@dataclass
class MixtureEnv:
    """One environment of the mixture: its config entry, the task, its token budget and held-out problems."""

    spec: EnvSection
    task: Task
    max_tokens: int
    eval_problems: list[Problem]
    exclude: set[str] = field(default_factory=set)  # held-out prompts, never drawn for training
    tools: ToolRollout | None = None  # a tool task's multi-turn episodes (set by the trainer); None: single turn

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ready(self) -> bool:
        """Whether new groups may be drawn from it now (the critic's waits for its first comparisons)."""
        return True

    @property
    def trains(self) -> bool:
        """False for an `eval_only` entry: evaluated, but the groups drawn for it are not started."""
        return not self.spec.eval_only

    def draw(self, seed: int, iteration: int) -> Problem:
        """The training problem for a group seeded `seed`, at the curriculum's levels of `iteration`."""
        return next(problems(self.task, self.spec.levels_at(iteration), seed, self.exclude))


def build_mixture(cfg: RLConfig, seed: int,
                  build_special: Callable[[EnvSection, RLConfig, int], MixtureEnv | None] | None = None,
                  ) -> list[MixtureEnv]:
    """The run's environments, with held-out problems drawn from a stream of their own (held-out seed + 10_000);
    `build_special` builds the entries that are not tasks (e.g. `critic_env.build_loop_env`), None for others."""
    envs = []
    for spec in cfg.environments():
        special = build_special(spec, cfg, seed) if build_special is not None else None
        if special is not None:
            envs.append(special)
            continue
        task = tasks.get(spec.task_name)
        budget = spec.max_tokens or cfg.rollout.max_tokens or task.max_tokens
        count = spec.eval_problems or cfg.task.eval_problems
        held_out = held_out_problems(task, spec.difficulties, count, cfg.held_out_seed())
        envs.append(MixtureEnv(spec, task, budget, held_out, {p.prompt for p in held_out}))
    if not any(e.trains for e in envs):
        raise ValueError("every [[envs]] entry is eval_only: the mixture has nothing to train on")
    return envs


def choose_env(envs: Sequence[MixtureEnv], seed: int) -> MixtureEnv:
    """The environment of a new group seeded `seed`, drawn by weight among the ready ones (no draw with one)."""
    ready = [e for e in envs if e.ready]
    if not ready:
        raise ValueError("no environment of the mixture is ready to draw from")
    if len(ready) == 1:
        return ready[0]
    return random.Random(seed).choices(ready, weights=[e.spec.weight for e in ready])[0]


def problems(task: Task, difficulties: list[int], seed: int, exclude: set[str]) -> Iterator[Problem]:
    """An endless, seeded stream of problems at random `difficulties`, skipping `exclude`d prompts."""
    rng = random.Random(seed)
    while True:
        problem = task.generate(rng.randrange(2**31), rng.choice(difficulties))
        if problem.prompt not in exclude:
            yield problem


def held_out_problems(task: Task, difficulties: list[int], count: int, seed: int) -> list[Problem]:
    """`count` distinct evaluation problems (a seed stream of their own)."""
    out = distinct_problems(task, difficulties, count, seed + 10_000)
    if out is None:
        raise ValueError(f"task {task.name} at difficulties {difficulties} has fewer than {count} distinct problems")
    return out


def distinct_problems(task: Task, difficulties: list[int], count: int, seed: int,
                      exclude: frozenset[str] = frozenset()) -> list[Problem] | None:
    """`count` problems with distinct prompts, none in `exclude`, from the stream of `seed`; None if 100 draws
    per wanted problem do not find them (the caller says what that means for its setting)."""
    seen: set[str] = set()
    out: list[Problem] = []
    stream = problems(task, difficulties, seed, set(exclude))
    for _ in range(count * 100):
        problem = next(stream)
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            out.append(problem)
            if len(out) == count:
                return out
    return None


__all__ = ["MixtureEnv", "build_mixture", "choose_env", "distinct_problems", "held_out_problems", "problems"]
