"""Gradient buckets whose reductions start during backward (ZeRO-1's DP overlap, `parallel.overlap_grad_reduce`).

The parameters of one replication group (Muon and AdamW alike) are cut into buckets of at most `cap` elements
in reverse registration order, which is roughly the order backward finishes their gradients (lm_head first,
the embedding last). Each bucket's reduction is a few collectives its parts issue (`reduce_bucket`: a
`dist.reduce` per Muon owner, one reduce-scatter for the AdamW shards), always with async_op=True.

Overlap on: `arm(fires)` before the step's last backward (or, under a pipeline, before the whole step, with
`fires` = micro-batches: each stage parameter accumulates once per micro-batch) makes every parameter's
post-accumulate-grad hook count its gradients; once all of a bucket's parameters have `fires` of them, the
bucket is final and goes out from inside backward. Buckets go out in index order only, as DDP's reducer does,
so every rank issues the same collectives in the same order however its hooks interleave. `drain()` issues the
rest (parameters no forward reached count as zero gradients), then waits for all of it. The hooks are
registered after mixed.py's fp32 accumulation hook, so under bf16 weights they see the summed fp32 gradient.
Overlap off: no hooks; `drain()` issues every bucket at once. The buckets and collectives are the same in both
modes, so the reduced gradients are bit-identical. Hook-issued collectives use a process group of their own
(`dedicated_groups`): they are issued at a rank-dependent moment, and must not interleave with the trainer's
own collectives (loss and count sums, EP all-to-alls) on a shared group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from openk2.train.parallel import comm_clock
from openk2.train.parallel.mesh import ParallelMesh

DEFAULT_GRAD_BUCKET_NUMEL = 1 << 22  # 16 MB of fp32 per bucket (DDP's default bucket is 25 MB)

Pending = tuple[object | None, Callable[[], None]]  # (an async collective's Work or None, what to do once done)


class BucketPart(Protocol):
    """An optimizer part whose parameters a GradBuckets reduces (DistributedMuon, ShardedAdamW)."""

    params: list[nn.Parameter]

    def reduce_bucket(self, indices: list[int], group: dist.ProcessGroup | None) -> list[Pending]:
        """Issue the reduction of params[i] for i in `indices` (freeing their gradients); what to finish."""


@dataclass
class OverlapStats:
    """Buckets issued from backward hooks (`early`: while another bucket still awaited a gradient) vs at drain."""

    hook: int = 0
    early: int = 0
    drain: int = 0
    last: tuple[int, int] = (0, 0)  # (hook, drain) of the last drained cycle


def _zero_grad(p: nn.Parameter) -> None:
    p.grad = None
    if hasattr(p, "main_grad"):
        p.main_grad = None


class GradBuckets:
    """The gradient buckets of `parts` (one replication group), reduced over `group`."""

    def __init__(self, parts: list[BucketPart], order: list[nn.Parameter], group: dist.ProcessGroup | None,
                 cap: int, hooks: bool) -> None:
        if cap < 1:
            raise ValueError(f"grad bucket size must be at least 1 element, got {cap}")
        self.parts, self.group = parts, group
        position = {id(p): i for i, p in enumerate(order)}
        entries = [(k, i) for k, part in enumerate(parts) for i in range(len(part.params))]
        entries.sort(key=lambda e: -position[id(parts[e[0]].params[e[1]])])  # reverse registration order
        self.buckets: list[list[tuple[int, int]]] = []
        size = 0
        for k, i in entries:
            numel = parts[k].params[i].numel()
            if not self.buckets or size + numel > cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append((k, i))
            size += numel
        self.bucket_of = {id(parts[k].params[i]): b for b, run in enumerate(self.buckets) for k, i in run}
        self.stats = OverlapStats()
        self.hooked = hooks
        self._armed = 0
        self._reset()
        if hooks:
            for run in self.buckets:
                for k, i in run:
                    parts[k].params[i].register_post_accumulate_grad_hook(self._on_grad)

    def _reset(self) -> None:
        self._next = 0
        self._pending: list[Pending] = []
        self._fires: dict[int, int] = {}
        self._waiting = [len(run) for run in self.buckets]
        self._cycle = [0, 0]  # (hook, drain) launches of this cycle

    @property
    def in_progress(self) -> bool:
        """Whether a cycle was armed or has buckets in flight (drain() ends it)."""
        return self._armed > 0 or self._next > 0

    def arm(self, fires: int) -> None:
        """Reduce each bucket from the hooks once each of its parameters has accumulated `fires` more gradients."""
        if fires < 1:
            raise ValueError(f"fires must be at least 1, got {fires}")
        if self._next:
            raise RuntimeError("arm() while buckets of the previous backward are in flight: drain() first")
        self._reset()
        self._armed = fires

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._armed:
            return
        key = id(p)
        self._fires[key] = self._fires.get(key, 0) + 1
        if self._fires[key] != self._armed:
            return
        self._waiting[self.bucket_of[key]] -= 1
        with torch.no_grad(), comm_clock.timed():  # packing and issuing run on backward's critical path
            while self._next < len(self.buckets) and self._waiting[self._next] == 0:
                early = any(self._waiting[self._next + 1:])
                self._launch(self._next)
                self.stats.hook += 1
                self.stats.early += int(early)
                self._cycle[0] += 1

    def _launch(self, b: int) -> None:
        by_part: dict[int, list[int]] = {}
        for k, i in self.buckets[b]:
            by_part.setdefault(k, []).append(i)
        for k, indices in by_part.items():
            self._pending += self.parts[k].reduce_bucket(indices, self.group)
            for i in indices:
                _zero_grad(self.parts[k].params[i])
        self._next = b + 1

    @torch.no_grad()
    def drain(self) -> None:
        """Issue the buckets not yet out (missing gradients are zeros), wait for every one, finish them in order."""
        for run in self.buckets[:self._next]:  # a gradient after its bucket went out would be silently lost
            for k, i in run:
                p = self.parts[k].params[i]
                if p.grad is not None or getattr(p, "main_grad", None) is not None:
                    raise RuntimeError(f"a gradient of a {tuple(p.shape)} parameter arrived after its bucket was "
                                       f"reduced: more than {self._armed} accumulations since arm()")
        with comm_clock.timed():
            while self._next < len(self.buckets):
                self._launch(self._next)
                self.stats.drain += 1
                self._cycle[1] += 1
            for work, done in self._pending:
                if work is not None:
                    work.wait()
                done()
        self.stats.last = (self._cycle[0], self._cycle[1])
        self._armed = 0
        self._reset()


def dedicated_groups(mesh: ParallelMesh) -> dict[str, dist.ProcessGroup]:
    """New process groups with the ranks of "data" (dense weights) and "dp" (routed experts), for this rank.

    Every rank creates every group, in the same order (torch.distributed.new_group's rule)."""
    ranks = mesh.mesh.mesh  # [pp, dp, ep] global ranks
    pp, dp, ep = ranks.shape
    layouts = {"dense": [ranks[p].flatten().tolist() for p in range(pp)],
               "expert": [ranks[p, :, e].tolist() for p in range(pp) for e in range(ep)]}
    out: dict[str, dist.ProcessGroup] = {}
    for where, lists in layouts.items():
        for members in lists:
            group = dist.new_group(sorted(members))
            if mesh.rank in members:
                out[where] = group
    return out


def same_ranks(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    """Whether two groups hold the same global ranks in the same order (None: the world)."""
    def ranks(g):
        return dist.get_process_group_ranks(g if g is not None else dist.group.WORLD)
    return ranks(a) == ranks(b)
