"""Where the RL rollout runs: in the trainer's process (colocated, the default) or on Ray actors.

A placement does two things for `RLTrainer.iterate`: run one rollout phase on the iteration's groups
(`rollout`) and move the trainer's new weights to the rollout engines (`sync`). The trainer keeps the
`PartialRollout` (its paused groups are part of the RL checkpoint) in both placements; a Ray placement sends
each worker its share of the groups and merges what comes back in the colocated order, so the training
batch, and with it the run, is the same (`rl/group_split.py`). Ray itself is imported only by `rl/ray_placement.py`,
which is imported only when `rollout.placement = "ray"`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Protocol

import torch

from openk2.rl.ckpt_engine import BroadcastStats, sync_in_process
from openk2.rl.config import RolloutSection
from openk2.rl.engine_switch import TrainingStateOffload
from openk2.rl.group_split import RolloutWorkerError
from openk2.rl.rollout import Group, PartialRollout, RolloutStats

PLACEMENTS = ("colocated", "ray")


class Placement(Protocol):
    """The rollout engines of an RL run, wherever they live."""

    def rollout(self, new_groups: Sequence[Group], *, iteration: int, version: int,
                temperature: float) -> tuple[list[Group], RolloutStats]: ...

    def sync(self, policy_state: Mapping[str, torch.Tensor]) -> BroadcastStats: ...

    def close(self) -> None: ...


class ColocatedPlacement:
    """The rollout engine on the trainer's own inference copy, in this process."""

    def __init__(self, inference: torch.nn.Module, tokenizer, rollout: PartialRollout, bucket_bytes: int,
                 offload: TrainingStateOffload | None = None) -> None:
        """`offload`: engine switching, the training state off the GPU while the rollout runs (a no-op on CPU)."""
        self.inference, self.tokenizer, self.partial = inference, tokenizer, rollout
        self.bucket_bytes = bucket_bytes
        self.offload = offload

    def rollout(self, new_groups: Sequence[Group], *, iteration: int, version: int,
                temperature: float) -> tuple[list[Group], RolloutStats]:
        """Resume the paused groups and start `new_groups` (PartialRollout.run on the inference copy)."""
        with self.offload.during_rollout() if self.offload is not None else nullcontext():
            return self.partial.run(self.inference, self.tokenizer, new_groups, iteration=iteration,
                                    version=version, temperature=temperature)

    def sync(self, policy_state: Mapping[str, torch.Tensor]) -> BroadcastStats:
        """Copy the new weights into the inference copy (the checkpoint engine's in-process form)."""
        return sync_in_process(policy_state, self.inference.state_dict(), bucket_bytes=self.bucket_bytes)

    def close(self) -> None:
        """Nothing to release."""


def build_placement(rc: RolloutSection, policy: torch.nn.Module, inference: torch.nn.Module, tokenizer,
                    rollout: PartialRollout, *, bucket_bytes: int, threads: int = 0, optimizer=None) -> Placement:
    """The placement `rc.placement` names; "ray" starts its workers and sends them the policy's weights
    (`bucket_bytes`: the checkpoint engine's bucket size; `threads`: each worker's torch threads, 0: default;
    `optimizer`: colocated on a GPU, its state and the policy leave the device during each rollout)."""
    if rc.placement == "colocated":
        offload = TrainingStateOffload(policy, optimizer) if optimizer is not None else None
        return ColocatedPlacement(inference, tokenizer, rollout, bucket_bytes, offload)
    from openk2.rl.ray_placement import RayPlacement  # imports ray: only on this path

    return RayPlacement(rc, policy, inference, tokenizer, rollout, bucket_bytes=bucket_bytes, threads=threads)


__all__ = ["PLACEMENTS", "ColocatedPlacement", "Placement", "RolloutWorkerError", "build_placement"]
