"""Self-critique in the RL loop (report 3.2.2): the policy as critic, rewarding open-ended prompts by pairwise
rubric comparisons of its own samples, and refined on-policy from verifiable signals (closed loop).

Two pieces, both usable by the RL loop's mixture of environments:

- `SelfCritiqueReward`: the reward of a group of responses to an open-ended prompt is each one's round-robin
  win share under `SelfCritic` (core, prescriptive and task rubrics, both orders per pair), minus a fixed
  penalty per named reward hack the text shows, found without the critic (`hack_flags`): a flattering
  opener, an unverifiable claim ("I verified this", "100% correct", "studies show"), or flattering length
  (far longer than the group's median). The penalty does not depend on the critic, so a policy cannot buy
  reward by fooling a weak critic with these.
- `CriticRefinementTask`: a verifiable task made of the critic's own job. Each iteration, the verifiable
  groups (responses and their verified rewards) are `observe`d; every pair whose rewards differ becomes one
  comparison problem per order (the critic's prompt, the better response known). Rolled out like any task,
  the policy writes verdicts and `verify` scores them against the verifier, so the same policy-gradient
  update that trains the actor trains the critic on its own, current judgments: the closed loop. The mean
  reward of these groups is the critic's sampled accuracy against the verifier; `greedy_accuracy` measures
  it at temperature 0 with `SelfCritic.compare` (both orders), as `CriticCalibration` does.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import statistics
from collections.abc import Sequence

from openk2.rl.critic import (
    DEFAULT_RUBRICS,
    RUBRIC_FORMAT,
    TASK_RUBRICS,
    CriticCalibration,
    CriticFormat,
    Rubric,
    SelfCritic,
)
from openk2.rl.tasks.base import Problem, Task

LOOP_RUBRICS = DEFAULT_RUBRICS + TASK_RUBRICS
HACK_PENALTY = 0.5  # subtracted per named hack found: two hacks cost a whole win share (rewards are in [0, 1])
LENGTH_RATIO = 2.0  # "flattering length": longer than this many times the group's median length ...
LENGTH_SLACK = 64  # ... and by more than this many characters (short groups vary a lot in relative terms)
SCAN_CHARS = 20_000  # hack patterns look at most at this many leading characters (hostile, huge responses)

_FLATTERY_RE = re.compile(r"^\W*(what an? |such an? )?(great|excellent|fantastic|wonderful|amazing|good|brilliant)"
                          r" (question|point|idea|prompt)", re.IGNORECASE)
_CLAIM_RE = re.compile(
    r"\bI(?: have|'ve)? (?:double[- ])?(?:checked|verified|tested|ran|run|confirmed)\b"
    r"|\b100 ?% (?:correct|accurate|sure|certain)\b|\bguaranteed? (?:to be )?(?:correct|accurate)\b"
    r"|\b(?:studies|research|experts|scientists) (?:show|shows|prove|proves|agree|confirm)\b"
    r"|\b(?:this|my) (?:answer|response|solution) is (?:correct|accurate|complete|verified)\b", re.IGNORECASE)


def hack_flags(response: str, group: Sequence[str]) -> dict[str, bool]:
    """Which named reward hacks `response` shows, judged against its `group` (itself included).

    >>> hack_flags("Great question! I verified it: 4.", ["Great question! I verified it: 4.", "4", "It is 4."])
    {'flattery': True, 'unverifiable_claim': True, 'length': False}
    """
    head = response[:SCAN_CHARS]
    median = statistics.median(len(r) for r in group) if group else len(response)
    return {"flattery": bool(_FLATTERY_RE.search(head)), "unverifiable_claim": bool(_CLAIM_RE.search(head)),
            "length": len(response) > LENGTH_RATIO * median and len(response) > median + LENGTH_SLACK}


class SelfCritiqueReward:
    """Group rewards for open-ended prompts: the policy-as-critic's win share minus the hack penalties."""

    def __init__(self, critic: SelfCritic, hack_penalty: float = HACK_PENALTY) -> None:
        if hack_penalty < 0:
            raise ValueError(f"hack_penalty must be >= 0, got {hack_penalty}")
        self.critic, self.hack_penalty = critic, hack_penalty

    def group_rewards(self, prompt: str, responses: Sequence[str]) -> list[float]:
        """One reward in [0, 1] per response (at least two) to `prompt`."""
        wins = self.critic.rewards(prompt, responses)
        return [max(0.0, w - self.hack_penalty * sum(hack_flags(r, responses).values()))
                for w, r in zip(wins, responses, strict=True)]


def verdict_score(reply: str, fmt: CriticFormat = RUBRIC_FORMAT, first: str = "", second: str = "") -> float:
    """Response A's share of the win in one critic reply (to the comparison of `first` with `second` in `fmt`),
    mandatory violations overriding (as SelfCritic.compare does for each order); 0.5 for a tie or no verdict.

    >>> verdict_score("Winner: A"), verdict_score("Violations: A\\nWinner: A"), verdict_score("no idea")
    (1.0, 0.0, 0.5)
    """
    winner, (a_bad, b_bad) = fmt.parse(reply, first, second)
    if a_bad != b_bad:
        return 0.0 if a_bad else 1.0
    return {"A": 1.0, "B": 0.0}.get(winner or "", 0.5)


class CriticRefinementTask(Task):
    """The critic's verifiable task: judge a pair of the policy's own responses whose verified rewards differ;
    reward 1 when the verdict prefers the better-verified one (see the module docstring)."""

    name = "critic-refinement"
    num_difficulties = 1
    max_tokens = 64  # a verdict: brief reasoning, then the two closing lines

    def __init__(self, rubrics: Sequence[Rubric] = LOOP_RUBRICS, max_pairs_per_group: int = 4,
                 max_pool: int = 512, seed: int = 0, fmt: CriticFormat = RUBRIC_FORMAT,
                 max_tokens: int = 64) -> None:
        """`max_pairs_per_group` pairs (each in both orders) are kept per observed group, the newest `max_pool`
        comparisons overall (older ones came from an older policy); `fmt` words the comparisons and reads the
        verdicts (the rubric prompt, or `critic_compact.COMPACT_FORMAT` for small policies)."""
        if max_pairs_per_group < 1 or max_pool < 2:
            raise ValueError("max_pairs_per_group must be >= 1 and max_pool >= 2")
        if not rubrics:
            raise ValueError("the critic needs at least one rubric")
        self.rubrics, self.fmt, self.max_tokens = list(rubrics), fmt, max_tokens
        self.max_pairs_per_group, self.max_pool = max_pairs_per_group, max_pool
        self.rng = random.Random(seed)
        self.pool: list[Problem] = []

    def observe(self, problem: Problem, responses: Sequence[str], rewards: Sequence[float]) -> int:
        """Add comparisons from one verified group; returns how many were added (0 when all rewards tie)."""
        if len(responses) != len(rewards):
            raise ValueError(f"{len(responses)} responses but {len(rewards)} rewards")
        pairs = [(i, j) for i, j in itertools.combinations(range(len(responses)), 2) if rewards[i] != rewards[j]]
        added = []
        for i, j in self.rng.sample(pairs, min(len(pairs), self.max_pairs_per_group)):
            better = i if rewards[i] > rewards[j] else j
            for first, second in ((i, j), (j, i)):  # both orders: a position-biased critic scores 0.5
                target = "A" if first == better else "B"
                prompt = self.fmt.messages(self.rubrics, problem.prompt, responses[first],
                                           responses[second])[0]["content"]
                added.append(Problem(prompt, {"target": target, "source": problem.task,
                                              "rewards": [float(rewards[first]), float(rewards[second])],
                                              "responses": [responses[first], responses[second]]},
                                     task=self.name, seed=len(self.pool) + len(added)))
        self.pool = (self.pool + added)[-self.max_pool:]
        return len(added)

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        """The pool's comparison number `seed` (modulo its size); the pool grows as groups are observed."""
        self._check_difficulty(difficulty)
        if not self.pool:
            raise ValueError("critic-refinement has no comparisons yet: observe verified groups first")
        return self.pool[seed % len(self.pool)]

    def verify(self, problem: Problem, response_text: str) -> float:
        """1.0 if the verdict prefers the better-verified response, else 0.0 (ties and no verdict included)."""
        first, second = problem.data.get("responses", ("", ""))
        score = verdict_score(response_text, self.fmt, first, second)
        return float(score != 0.5 and (score > 0.5) == (problem.data["target"] == "A"))

    def state_dict(self) -> dict:
        """The pool and the pair-sampling RNG, JSON-ready (saved in RL checkpoints: the pool cannot be rebuilt)."""
        version, internal, gauss = self.rng.getstate()
        return {"pool": [dataclasses.asdict(p) for p in self.pool], "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved."""
        self.pool = [Problem(**p) for p in state["pool"]]
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


def greedy_accuracy(critic: SelfCritic, task: Task, problems: Sequence[Problem],
                    responses: Sequence[Sequence[str]]) -> float | None:
    """The critic's temperature-0 agreement with the verifier over every pair of each group's responses whose
    verified rewards differ (both orders per pair); None when no pair differs."""
    calibration = CriticCalibration()
    for problem, group in zip(problems, responses, strict=True):
        calibration.check(critic, task, problem, group)
    return calibration.agreement_rate


__all__ = ["CriticRefinementTask", "LOOP_RUBRICS", "SelfCritiqueReward", "greedy_accuracy", "hack_flags",
           "verdict_score"]
