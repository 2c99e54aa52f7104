"""Where the RL rollout runs: in the trainer's process (colocated, the default) or on Ray actors.

A placement does two things for `RLTrainer.iterate`: run one rollout phase on the iteration's groups
(`rollout`: the single-turn groups with partial rollout, then the multi-turn tool groups played to their end in
place) and move the trainer's new weights to the rollout engines (`sync`). The trainer keeps the
`PartialRollout` (its paused groups are part of the RL checkpoint) in both placements; a Ray placement sends
each worker its share of the groups and merges what comes back in the colocated order, so the training
batch, and with it the run, is the same (`rl/group_split.py`). Ray itself is imported only by `rl/ray_placement.py`,
which is imported only when `rollout.placement = "ray"`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Protocol

import torch

from openk2.rl.ckpt_engine import BroadcastStats, sync_in_process
from openk2.rl.config import RolloutSection
from openk2.rl.engine_switch import TrainingStateOffload
from openk2.rl.group_split import RolloutWorkerError
from openk2.rl.rollout import Group, PartialRollout, RolloutStats
from openk2.rl.tool_rollout import ToolRollout, run_tool_groups

PLACEMENTS = ("colocated", "ray")


class Placement(Protocol):
    """The rollout engines of an RL run, wherever they live."""

    def rollout(self, new_groups: Sequence[Group], *, iteration: int, version: int, temperature: float,
                tool_groups: Sequence[Group] = ()) -> tuple[list[Group], RolloutStats]: ...

    def sync(self, policy_state: Mapping[str, torch.Tensor]) -> BroadcastStats: ...

    def close(self) -> None: ...


class ColocatedPlacement:
    """The rollout engine on the trainer's own inference copy, in this process."""

    def __init__(self, inference: torch.nn.Module, tokenizer, rollout: PartialRollout, bucket_bytes: int,
                 offload: TrainingStateOffload | None = None, tools: Mapping[str, ToolRollout] | None = None) -> None:
        """`offload`: engine switching, the training state off the GPU while the rollout runs (a no-op on CPU);
        `tools`: the tool environments' episode runners by environment name."""
        self.inference, self.tokenizer, self.partial = inference, tokenizer, rollout
        self.bucket_bytes = bucket_bytes
        self.offload = offload
        self.tools = dict(tools or {})

    def rollout(self, new_groups: Sequence[Group], *, iteration: int, version: int, temperature: float,
                tool_groups: Sequence[Group] = ()) -> tuple[list[Group], RolloutStats]:
        """Resume the paused groups and start `new_groups` (PartialRollout.run on the inference copy), then play
        `tool_groups` to their end in place; the stats' `new_tokens` counts both."""
        with self.offload.during_rollout() if self.offload is not None else nullcontext():
            done, stats = self.partial.run(self.inference, self.tokenizer, new_groups, iteration=iteration,
                                           version=version, temperature=temperature)
            tool_tokens = run_tool_groups(self.tools, tool_groups, self.inference, iteration=iteration,
                                          version=version, temperature=temperature)
        return done, dataclasses.replace(stats, new_tokens=stats.new_tokens + tool_tokens)

    def sync(self, policy_state: Mapping[str, torch.Tensor]) -> BroadcastStats:
        """Copy the new weights into the inference copy (the checkpoint engine's in-process form)."""
        return sync_in_process(policy_state, self.inference.state_dict(), bucket_bytes=self.bucket_bytes)

    def close(self) -> None:
        """Nothing to release."""


def build_placement(rc: RolloutSection, policy: torch.nn.Module, inference: torch.nn.Module, tokenizer,
                    rollout: PartialRollout, *, bucket_bytes: int, threads: int = 0, optimizer=None,
                    tools: Mapping[str, ToolRollout] | None = None) -> Placement:
    """The placement `rc.placement` names; "ray" starts its workers and sends them the policy's weights
    (`bucket_bytes`: the checkpoint engine's bucket size; `threads`: each worker's torch threads, 0: default;
    `optimizer`: colocated on a GPU, its state and the policy leave the device during each rollout; `tools`:
    the tool environments by name, whose episodes the placement's engines play)."""
    if rc.placement == "colocated":
        offload = TrainingStateOffload(policy, optimizer) if optimizer is not None else None
        return ColocatedPlacement(inference, tokenizer, rollout, bucket_bytes, offload, tools)
    from openk2.rl.ray_placement import RayPlacement  # imports ray: only on this path

    return RayPlacement(rc, policy, inference, tokenizer, rollout, bucket_bytes=bucket_bytes, threads=threads,
                        tools=tools)


__all__ = ["PLACEMENTS", "ColocatedPlacement", "Placement", "RolloutWorkerError", "build_placement"]
