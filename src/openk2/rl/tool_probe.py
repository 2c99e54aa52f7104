"""The tool warm-up's adaptive stop: warm up until the policy's greedy success on a small probe set first reaches
a target band, so RL starts where it has room and signal (docs/rl.md, "Multi-turn tool environments").

A fixed warm-up length leaves the tiny policy all-or-nothing by seed (the step at which it learns to copy the
looked-up price moves with the seed), so the stop is measured instead: every `warmup.probe_every` steps the
policy plays one greedy episode per probe problem, and the warm-up ends at the first check whose success is at
least `probe_low`. `probe_high` marks a check that jumped past the band between two checks (it stops there too:
going on would only move further from the band). `warmup.steps` is the cap.

The probe problems come from a seed stream of their own (run seed + 20_000; the held-out ones use + 10_000) and
skip every held-out prompt, so the stop never looks at the evaluation set. They are added to the environment's
`exclude` set, so neither the warm-up nor RL ever trains on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from openk2.rl.mixture import MixtureEnv, distinct_problems
from openk2.rl.tasks import Problem
from openk2.rl.tasks.tool_task import ToolTask

PROBE_SEED_OFFSET = 20_000
PROBE_FILE = "probe.json"  # written into the run's warmup/ directory


def probe_problems(env: MixtureEnv, count: int, seed: int) -> list[Problem]:
    """`count` distinct probe problems of `env` at its difficulties, none of them a held-out prompt."""
    held_out = frozenset(p.prompt for p in env.eval_problems)
    out = distinct_problems(env.task, env.spec.difficulties, count, seed + PROBE_SEED_OFFSET, held_out)
    if out is not None:
        return out
    raise ValueError(f"task {env.task.name} has fewer than {count} probe problems outside its held-out ones; "
                     "lower warmup.probe_problems")


def exclude_probes(envs: Sequence[MixtureEnv], count: int, seed: int) -> dict[str, list[Problem]]:
    """Probe problems of every tool environment (none without a probe), added to its `exclude` set."""
    if count == 0:
        return {}
    out = {}
    for env in envs:
        if isinstance(env.task, ToolTask):
            out[env.name] = probe_problems(env, count, seed)
            env.exclude |= {p.prompt for p in out[env.name]}
    return out


@dataclass
class ProbeStop:
    """The stop rule: check every `every` steps (and at the `cap`); stop at the first score >= `low`."""

    every: int
    low: float
    high: float
    cap: int
    trace: list[tuple[int, float]] = field(default_factory=list)  # (steps done, probe success) of every check
    stopped_at: int | None = None  # the step the rule stopped at; None: it ran to the cap below the band

    def due(self, step: int) -> bool:
        """Whether the probe runs after `step` warm-up steps."""
        return step % self.every == 0 or step == self.cap

    def check(self, step: int, score: float) -> bool:
        """Record one probe score; True when the warm-up should stop here."""
        self.trace.append((step, score))
        if score >= self.low:
            self.stopped_at = step
            return True
        return False

    def summary(self) -> dict:
        """What the run logs: the chosen step, whether it landed in the band, and every check."""
        last = self.trace[-1][1] if self.trace else None
        if self.stopped_at is None:
            where = "below"
        else:
            where = "in" if last is not None and last <= self.high else "above"
        return {"stopped_at": self.stopped_at, "steps": self.trace[-1][0] if self.trace else 0, "band": where,
                "low": self.low, "high": self.high, "cap": self.cap,
                "checks": [{"step": s, "success": v} for s, v in self.trace]}


__all__ = ["PROBE_FILE", "PROBE_SEED_OFFSET", "ProbeStop", "exclude_probes", "probe_problems"]
