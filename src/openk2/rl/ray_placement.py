"""Rollout workers as Ray actors, fed by the trainer's checkpoint engine over torch.distributed.

Layout (docs/rl.md, "Placement"): the trainer stays in the driver process, which owns the policy, the
optimizer, the paused groups, the RNG and the checkpoints, exactly as colocated; only the rollout engines move
out. `num_workers` `RolloutWorker` actors are placed with one placement-group bundle each (`worker_num_cpus`
CPUs, `worker_num_gpus` GPUs). The driver (rank 0) and the workers (ranks 1..N) form a process group of their
own (`rl/sync_group.py`: gloo, or nccl when the policy and the workers are on CUDA; not the default group, which
the training code reduces over) whose store listens on a free port of the driver's node. Every weight update is
one `CheckpointEngine.broadcast` from rank 0, which also refreshes the driver's own inference copy (held for
evaluation). Through Ray go only small things: the model config, the tokenizer files, the tool environments'
specs (task names and budgets), the groups' token ids and log-probs (and routing records), and the stats.
Multi-turn tool groups are split like the others and played to their end on the workers in the same call, after
the single-turn groups, as the colocated placement does; the driver copies the episodes back into its groups.

A worker that dies or raises surfaces in the driver as a one-line `RolloutWorkerError` naming the worker; Ray calls wait
at most `worker_timeout_s`, and so does the weight-sync group.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from openk2.rl.ckpt_engine import BroadcastStats, CheckpointEngine, copy_into
from openk2.rl.config import RolloutSection
from openk2.rl.group_split import RolloutWorkerError, merge_groups, merge_stats, split_groups
from openk2.rl.ray_worker import RolloutWorker, tokenizer_files
from openk2.rl.rollout import Group, PartialRollout, RolloutStats
from openk2.rl.sync_group import StandaloneGroup, open_store
from openk2.rl.tool_rollout import ToolRollout


def _one_line(err: BaseException) -> str:
    """A Ray error as one line: the worker's own exception when it raised one, else the first line."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        err = cause
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


class RayPlacement:
    """`num_workers` rollout actors in a placement group; the trainer in this process broadcasts to them."""

    def __init__(self, rc: RolloutSection, policy: torch.nn.Module, inference: torch.nn.Module, tokenizer,
                 rollout: PartialRollout, *, bucket_bytes: int, threads: int = 0,
                 tools: Mapping[str, ToolRollout] | None = None) -> None:
        self.partial = rollout
        self.timeout_s = rc.worker_timeout_s
        self._owns_ray = not ray.is_initialized()
        address = rc.ray_address or os.environ.get("RAY_ADDRESS") or None
        if self._owns_ray:
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
        policy_device = next(policy.parameters()).device
        gpus = rc.worker_num_gpus
        backend = "nccl" if policy_device.type == "cuda" and gpus > 0 else "gloo"
        bundle = {"CPU": rc.worker_num_cpus, **({"GPU": gpus} if gpus > 0 else {})}
        if self._owns_ray and address is None:  # a local instance cannot grow: say so now, not after a timeout
            have = ray.cluster_resources()
            short = [k for k, v in bundle.items() if v * rc.num_workers > have.get(k, 0)]
            if short:
                ray.shutdown()
                raise ValueError(f"rollout.num_workers = {rc.num_workers} bundles of {bundle} need more {short} "
                                 f"than this machine's local Ray has ({have}); lower rollout.num_workers or "
                                 f"rollout.worker_num_cpus, or set rollout.ray_address")
        self.group = placement_group([dict(bundle) for _ in range(rc.num_workers)], strategy="PACK")
        self.workers: list = []
        self.sync_group: StandaloneGroup | None = None
        try:
            self._get([self.group.ready()], f"placing {rc.num_workers} bundle(s) of {bundle} "
                      f"(cluster resources: {ray.cluster_resources()})")
            actor = ray.remote(RolloutWorker)
            files = tokenizer_files(tokenizer)
            specs = {name: t.spec() for name, t in (tools or {}).items()}  # rebuilt in each worker
            for i in range(rc.num_workers):
                strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i)
                self.workers.append(actor.options(num_cpus=rc.worker_num_cpus, num_gpus=gpus, max_restarts=0,
                                                  scheduling_strategy=strategy).remote(
                    policy.config, files, _stateless(rollout), inference_dtype=rc.inference_dtype,
                    device="cuda" if gpus > 0 else "cpu", threads=threads, tools=specs))
            self.pids = self._get([w.pid.remote() for w in self.workers], "starting the rollout workers")
            host, world = ray.util.get_node_ip_address(), rc.num_workers + 1
            store = open_store(host, world, self.timeout_s)  # on a free port, before anyone connects
            joins = [w.join.remote(host, store.port, i + 1, world, backend, bucket_bytes, self.timeout_s)
                     for i, w in enumerate(self.workers)]
            self.sync_group = StandaloneGroup(host, store.port, 0, world, backend, self.timeout_s, store=store)
            self._get(joins, "joining the weight-sync group")
            self.engine = CheckpointEngine(bucket_bytes=bucket_bytes, group=self.sync_group,
                                           device=policy_device if backend == "nccl" else "cpu")
            self._receive_local = copy_into(dict(inference.state_dict()))
            self.sync(policy.state_dict())  # the workers start from random weights
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the two phases
    def rollout(self, new_groups: Sequence[Group], *, iteration: int, version: int, temperature: float,
                tool_groups: Sequence[Group] = ()) -> tuple[list[Group], RolloutStats]:
        """Resume the paused groups and start `new_groups`, then play `tool_groups` (their episodes copied back
        into these groups), all split across the workers by group id."""
        groups = self.partial.paused + list(new_groups)
        shares, tool_shares = split_groups(groups, len(self.workers)), split_groups(tool_groups, len(self.workers))
        calls = {w.rollout.remote(share, iteration, version, temperature, tools): f"rollout worker {i}"
                 for i, (w, share, tools) in enumerate(zip(self.workers, shares, tool_shares, strict=True))
                 if share or tools}
        results = self._wait_all(calls)
        done, self.partial.paused = merge_groups([g.group_id for g in groups], [g for r in results for g in r[0]])
        played, _ = merge_groups([g.group_id for g in tool_groups], [g for r in results for g in r[1]])
        if len(played) != len(tool_groups):
            raise RolloutWorkerError("rollout workers returned unfinished tool episodes")
        for mine, theirs in zip(tool_groups, played, strict=True):
            mine.trajectories = theirs.trajectories
        return done, merge_stats([r[2] for r in results], len(done))

    def sync(self, policy_state: Mapping[str, torch.Tensor]) -> BroadcastStats:
        """Broadcast the trainer's weights to every worker (and into the driver's inference copy).

        The driver's side of the broadcast runs on a helper thread while this one watches the workers' receive
        calls: a dead worker would otherwise leave the collective waiting for it until the group's timeout."""
        receives = {w.receive.remote(): f"weight sync to worker {i}" for i, w in enumerate(self.workers)}
        outcome: dict = {}

        def send() -> None:
            try:
                outcome["stats"] = self.engine.broadcast(policy_state, self._receive_local)
            except Exception as err:  # re-raised on the calling thread below
                outcome["error"] = err

        sender = threading.Thread(target=send, name="weight-sync", daemon=True)
        sender.start()
        try:
            self._wait_all(receives, until=lambda: not sender.is_alive())
        except RolloutWorkerError:
            self.sync_group.cancel()  # a peer is gone: let the sender thread unwind instead of waiting it out
            sender.join(5)
            raise
        sender.join(self.timeout_s)
        if "error" in outcome:
            raise RolloutWorkerError(f"weight sync failed: {_one_line(outcome['error'])}") from None
        if "stats" not in outcome:
            raise RolloutWorkerError(f"weight sync: no answer within rollout.worker_timeout_s = {self.timeout_s} s")
        self._wait_all(receives)
        return outcome["stats"]

    def digests(self) -> list[str]:
        """Each worker's `state_digest` of its inference copy (to check that a sync arrived bit-exact)."""
        return self._get([w.digest.remote() for w in self.workers], "digest")

    # ------------------------------------------------------------------ errors and shutdown
    def _wait_all(self, calls: dict, until: Callable[[], bool] | None = None) -> list:
        """The results of `calls` (ref -> what it does), in order; the first failure among them, whichever
        finishes first, is raised at once as one line. With `until`, returns [] as soon as `until()` holds
        and no call has failed (the rest are collected later)."""
        deadline = time.monotonic() + self.timeout_s
        pending = list(calls)
        while pending and not (until is not None and until()):
            if time.monotonic() > deadline:
                raise RolloutWorkerError(f"{calls[pending[0]]}: no answer within rollout.worker_timeout_s = "
                                   f"{self.timeout_s} s")
            ready, pending = ray.wait(pending, num_returns=1, timeout=0.2)
            for ref in ready:
                self._get([ref], calls[ref])  # raises if that call failed
        return [] if pending else self._get(list(calls), "collecting results")

    def _get(self, refs: list, what: str) -> list:
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RolloutWorkerError(f"{what}: no answer within rollout.worker_timeout_s = {self.timeout_s} s") \
                from None
        except ray.exceptions.RayError as err:
            raise RolloutWorkerError(f"{what} failed: {_one_line(err)}") from None

    def close(self) -> None:
        """Stop the workers, leave the process group, free the placement group (and Ray, if started here)."""
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        self.sync_group = None  # its store and connections close with it
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


def _stateless(rollout: PartialRollout) -> PartialRollout:
    """A copy of the rollout's settings without its paused groups (the trainer keeps those)."""
    copy = PartialRollout.__new__(PartialRollout)
    copy.__dict__.update({**rollout.__dict__, "paused": []})
    return copy


__all__ = ["RayPlacement"]
