"""Concurrent rollouts with partial rollout: long trajectories are paused at a per-iteration token budget and
resumed in the next iteration, keeping the log-probs their tokens were sampled with.

K2 report, section 4.2 ("Efficient System Startup & Agentic Rollout") after Kimi K1.5 (section 2.6.2): to keep a
few long trajectories from stalling every iteration, each trajectory may add at most `segment_tokens` tokens per
iteration. One that reaches this budget unfinished is paused (its engine sequence ends) and, in the next
iteration, re-enters the engine with prompt + generated-so-far as its prefix (a re-prefill under the new weights)
and continues. Every token remembers the log-prob and the policy version it was sampled with, so the loss's
pi_old is the policy that actually produced that token.

Rollouts are grouped: the K samples of one prompt form a `Group`, and a group goes to training only when all of
its samples have finished (the K1.5 loss centres rewards within a group). Up to `max_batch_size` samples decode
together in the engine (continuous batching: finished samples free their slot for waiting ones at once).

Engine switching (colocated, report 4.2): `PartialRollout.run` builds the engine, and with it the latent KV
cache, at the start of the rollout phase and drops it at the end, so the training phase gets that memory back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from openk2.infer.engine import Engine, GenerationResult
from openk2.infer.sampling import SamplingParams
from openk2.rl.routing_replay import extend_routing
from openk2.rl.tasks import Problem

_SEED_MOD = 2**62


@dataclass
class Trajectory:
    """One sampled response, possibly built over several iterations."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # per token, under the policy that sampled it (temp 1)
    versions: list[int] = field(default_factory=list)  # per token, the policy version that sampled it
    finish_reason: str | None = None  # "stop", "length" (hit max_tokens: truncated), None while unfinished
    num_segments: int = 0  # rollout iterations this trajectory has run in
    # R3: per position of prompt + response (the last token excluded), the L*K experts the rollout ran; empty
    # unless the rollout records routing (openk2.rl.routing_replay)
    routing: list[list[int]] = field(default_factory=list)
    # per token, 1 where the policy sampled it and 0 where an environment wrote it (a multi-turn episode's tool
    # results, openk2.rl.tool_episode: context, never trained on); empty: every token was sampled
    mask: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_result(cls, result: GenerationResult, version: int = 0) -> Trajectory:
        """A one-segment trajectory from one engine result (with its routing when the engine recorded it)."""
        traj = cls(list(result.prompt_token_ids))
        extend_routing(traj, result.routing, len(result.prompt_token_ids))  # before the tokens: a first segment
        traj.token_ids, traj.logprobs = list(result.token_ids), list(result.logprobs)
        traj.versions = [version] * len(result.token_ids)
        traj.finish_reason, traj.num_segments = result.finish_reason, 1
        return traj

    @property
    def logprob_old(self) -> float:
        """log pi_old(y|x): the sum of the sampled tokens' log-probs (context tokens carry 0)."""
        return float(sum(self.logprobs))

    @property
    def num_sampled(self) -> int:
        """Tokens the policy sampled (all of them unless `mask` marks environment-written context)."""
        return sum(self.mask) if self.mask else len(self.token_ids)


@dataclass
class Group:
    """The K samples of one problem; trained on once they have all finished."""

    group_id: int
    problem: Problem
    trajectories: list[Trajectory]
    started_at: int  # the iteration its first tokens were sampled in
    env: str = ""  # the environment of the mixture it was drawn from ("": the run's only one)
    max_tokens: int = 0  # its response budget (an environment's own); 0: the rollout's max_tokens

    @property
    def complete(self) -> bool:
        return all(t.finished for t in self.trajectories)

    def to_dict(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "problem": dataclasses.asdict(self.problem),
                "trajectories": [dataclasses.asdict(t) for t in self.trajectories], "started_at": self.started_at,
                "env": self.env, "max_tokens": self.max_tokens}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Group:
        return cls(raw["group_id"], Problem(**raw["problem"]), [Trajectory(**t) for t in raw["trajectories"]],
                   raw["started_at"], raw.get("env", ""), raw.get("max_tokens", 0))


@dataclass
class RolloutStats:
    new_tokens: int  # tokens sampled in this iteration
    paused: int  # trajectories left unfinished at the budget (carried to the next iteration)
    resumed: int  # trajectories that continued one paused earlier
    completed_groups: int
    engine_steps: int


class PartialRollout:
    """Samples groups with an Engine, pausing trajectories at `segment_tokens` new tokens per iteration."""

    def __init__(self, *, max_tokens: int, segment_tokens: int | None = None, max_batch_size: int = 64,
                 stop_token_ids: Sequence[int] = (), seed: int = 0, record_routing: bool = False) -> None:
        """`max_tokens`: a response's total budget (reaching it finishes the trajectory as truncated);
        `segment_tokens`: at most this many new tokens per trajectory per iteration (None: no pausing);
        `record_routing`: keep each trajectory's MoE experts per position (`Trajectory.routing`, for R3)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if segment_tokens is not None and segment_tokens < 1:
            raise ValueError(f"segment_tokens must be >= 1 (or unset), got {segment_tokens}")
        self.max_tokens = max_tokens
        self.segment_tokens = segment_tokens or max_tokens
        self.max_batch_size = max_batch_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.seed = seed
        self.record_routing = record_routing
        self.paused: list[Group] = []  # groups with unfinished trajectories, oldest first

    # ------------------------------------------------------------------ state (saved in RL checkpoints)
    def state_dict(self) -> dict[str, Any]:
        return {"paused": [g.to_dict() for g in self.paused]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.paused = [Group.from_dict(g) for g in state["paused"]]

    # ------------------------------------------------------------------ one rollout phase
    def run(self, model: torch.nn.Module, tokenizer, new_groups: Sequence[Group], *, iteration: int,
            version: int, temperature: float = 1.0, progress: bool = False) -> tuple[list[Group], RolloutStats]:
        """Resume the paused groups, start `new_groups`, and return the groups that are now complete.

        `version` tags the tokens sampled now (the policy version of `model`'s weights); seeds derive from
        (seed, iteration, group, sample), so a run is reproducible. Unfinished groups stay in `self.paused`.
        """
        groups = self.paused + list(new_groups)
        longest = max((len(t.prompt_ids) + self.budget(g) for g in groups for t in g.trajectories), default=1)
        engine = Engine(model, tokenizer, max_batch_size=self.max_batch_size, max_seq_len=longest,
                        record_routing=self.record_routing)
        owners: dict[str, tuple[list[Trajectory], int]] = {}  # request id -> (its trajectories, their budget)
        resumed = 0
        for g in groups:
            fresh = all(not t.token_ids for t in g.trajectories)
            if fresh:  # one request with n samples: the prompt is prefilled once for the whole group
                request = self._submit(engine, g, g.trajectories[0], len(g.trajectories), iteration, temperature)
                owners[request] = (g.trajectories, self.budget(g))
                continue
            for i, traj in enumerate(g.trajectories):
                if not traj.finished:
                    resumed += bool(traj.token_ids)
                    owners[self._submit(engine, g, traj, 1, iteration, temperature, sample=i)] = ([traj],
                                                                                              self.budget(g))
        new_tokens, steps = 0, 0
        bar = tqdm(total=sum(len(v) for v in owners.values()), desc="rollout", unit="sample", leave=False,
                   disable=not progress)
        while engine.has_unfinished():
            for result in engine.step():
                trajectories, budget = owners[result.request_id]
                new_tokens += self._extend(trajectories[result.sample_index], result, version, budget)
                bar.update(1)
            steps += 1
        bar.close()
        del engine  # release the KV cache before the training phase (nothing else holds it)
        done = [g for g in groups if g.complete]
        self.paused = [g for g in groups if not g.complete]
        paused = sum(not t.finished for g in self.paused for t in g.trajectories)
        return done, RolloutStats(new_tokens, paused, resumed, len(done), steps)

    def budget(self, group: Group) -> int:
        """`group`'s response budget: its environment's, else the rollout's `max_tokens`."""
        return group.max_tokens or self.max_tokens

    def _submit(self, engine: Engine, group: Group, traj: Trajectory, n: int, iteration: int, temperature: float,
                sample: int = 0) -> str:
        budget = min(self.segment_tokens, self.budget(group) - len(traj.token_ids))
        seed = hash((self.seed, iteration, group.group_id, sample)) % _SEED_MOD
        params = SamplingParams(max_tokens=budget, temperature=temperature, seed=seed, n=n,
                                stop_token_ids=self.stop_token_ids)
        return engine.add_request(traj.prompt_ids + traj.token_ids, params,
                                  request_id=f"g{group.group_id}-s{sample}")

    def _extend(self, traj: Trajectory, result: GenerationResult, version: int, budget: int) -> int:
        if self.record_routing:
            extend_routing(traj, result.routing, len(result.prompt_token_ids))
        traj.token_ids += result.token_ids
        traj.logprobs += result.logprobs
        traj.versions += [version] * len(result.token_ids)
        traj.num_segments += 1
        if result.finish_reason == "stop":
            traj.finish_reason = "stop"
        elif len(traj.token_ids) >= budget:
            traj.finish_reason = "length"  # truncated by the response budget (budget control penalises it)
        return len(result.token_ids)  # else: paused at the segment budget, resumed next iteration


def new_group(group_id: int, problem: Problem, prompt_ids: list[int], num_samples: int, iteration: int,
              env: str = "", max_tokens: int = 0) -> Group:
    """A group of `num_samples` empty trajectories for `problem` (from environment `env`, budget `max_tokens`)."""
    return Group(group_id, problem, [Trajectory(list(prompt_ids)) for _ in range(num_samples)], iteration, env,
                 max_tokens)


__all__ = ["Group", "PartialRollout", "RolloutStats", "Trajectory", "new_group"]
