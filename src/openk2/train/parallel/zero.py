"""Distributed MuonClip: the optimizer a parallel run steps (Muon + AdamW + QK-Clip, state sharded over DP).

Weights stay replicated within their replication group (ZeRO-1); optimizer state is split over it:

- Muon matrices (dist_muon.py): each has one owner in the group, balanced by Newton-Schulz FLOPs; its
  gradient is reduced to the owner, which keeps its momentum and orthogonalises it (batched by shape); the
  orthogonalised update is broadcast back (bf16 by default) and applied by every replica. Newton-Schulz runs
  once per matrix across the group.
- AdamW parameters (sharded_adamw.py): elementwise ZeRO-1 with DTensor, fp32 master and moments Shard(0).
- QK-Clip (K2 report, Algorithm 1): per-head max logits MAX-reduced over the whole world (data ranks saw
  different tokens, EP ranks too, and only the pipeline stage owning a layer filled its rows), then every
  replica rescales its own copy of the query/key weights alike; AdamW masters re-read the weights each step.

Gradients are reduced by bucket (grad_hooks.py), Muon and AdamW parameters of one group in the same buckets.
With `overlap_grad_reduce`, the trainer arms the buckets before the step's last backward (`arm_overlap`) and
each bucket goes out from backward hooks once its gradients are final; `reduce_gradients` then only drains.

Two replication groups exist: dense weights are replicated over every rank that reads its own tokens (dp x ep,
"data"), routed-expert weights only over "dp" (each EP rank holds different experts; with dp = 1 they are
orthogonalised locally with no communication at all).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from openk2.optim.muonclip import ClipStats
from openk2.optim.ns_kernel import pin_ns_kernel, select_ns_kernel
from openk2.optim.param_groups import MuonFilter, default_muon_filter
from openk2.optim.qk_clip import QKClip, reduce_max_logits, unrecorded_max_logits
from openk2.train.parallel import comm_clock
from openk2.train.parallel.dist_muon import DEFAULT_BUCKET_NUMEL, DistributedMuon, group_size
from openk2.train.parallel.grad_hooks import (
    DEFAULT_GRAD_BUCKET_NUMEL,
    GradBuckets,
    OverlapStats,
    dedicated_groups,
    same_ranks,
)
from openk2.train.parallel.mesh import ParallelMesh
from openk2.train.parallel.mixed import PARAM_DTYPES, accumulate_in_fp32, clear_fp32_grads, clip_factors
from openk2.train.parallel.pipeline import PipelineModel
from openk2.train.parallel.sharded_adamw import ShardedAdamW

ProcessGroup = dist.ProcessGroup | None


def _mesh_of(group: ProcessGroup, device: torch.device) -> DeviceMesh | None:
    """A 1-D DeviceMesh over `group` for DTensor (None when the group has one rank or nothing is distributed)."""
    if not dist.is_initialized() or group_size(group) == 1:
        return None
    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device.type)


class DistributedMuonClip:
    """MuonClip (Muon + AdamW + QK-Clip) with ZeRO-1 sharded state and once-per-matrix Newton-Schulz.

    `named_params` are this rank's (full-model name, parameter) pairs; `expert_names` those replicated only
    over `expert_group`, the rest are replicated over `dense_group`. `attention_layers` maps this rank's
    global layer index to its attention module (for QK-Clip). `update_dtype` is the dtype Muon updates travel
    in (default: `ns_dtype`, which loses nothing since Newton-Schulz already rounds its output to it).
    `overlap_grad_reduce` reduces gradient buckets (`grad_bucket_numel` elements) from backward hooks over
    `reduce_groups` ({"dense", "expert"}: groups of their own with the same ranks; created here when both
    groups are the world, else required).
    """

    def __init__(
        self,
        model: nn.Module,
        named_params: list[tuple[str, nn.Parameter]],
        attention_layers: dict[int, nn.Module],
        *,
        lr: float,
        weight_decay: float = 0.1,
        tau: float | None = 100.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        rms_scale: float = 0.2,
        ns_dtype: torch.dtype = torch.bfloat16,
        use_muon: bool = True,
        muon_filter: MuonFilter | None = None,
        expert_names: frozenset[str] = frozenset(),
        dense_group: ProcessGroup = None,
        expert_group: ProcessGroup = None,
        update_dtype: torch.dtype | None = None,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        param_dtype: torch.dtype = torch.float32,
        overlap_grad_reduce: bool = False,
        grad_bucket_numel: int = DEFAULT_GRAD_BUCKET_NUMEL,
        reduce_groups: dict[str, ProcessGroup] | None = None,
    ) -> None:
        if param_dtype not in PARAM_DTYPES.values():
            raise ValueError(f"param_dtype must be one of {sorted(PARAM_DTYPES)}, got {param_dtype}")
        self.model = model
        self.param_dtype = param_dtype
        master = param_dtype != torch.float32
        self.lr, self.weight_decay, self.tau = lr, weight_decay, tau
        keep = muon_filter or default_muon_filter
        members: dict[tuple[str, str], list[tuple[str, nn.Parameter]]] = {
            (where, kind): [] for where in ("dense", "expert") for kind in ("muon", "adamw")}
        for name, p in named_params:
            if p.requires_grad:
                kind = "muon" if use_muon and keep(name, p) else "adamw"
                members[("expert" if name in expert_names else "dense", kind)].append((name, p))
        device = named_params[0][1].device
        groups = {"dense": dense_group, "expert": expert_group}
        self.muon = {where: DistributedMuon([p for _, p in members[(where, "muon")]], groups[where],
                                            momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                            rms_scale=rms_scale, ns_dtype=ns_dtype, update_dtype=update_dtype,
                                            bucket_numel=bucket_numel, master=master)
                     for where in groups}
        self.adamw = {where: ShardedAdamW([p for _, p in members[(where, "adamw")]],
                                          _mesh_of(groups[where], device), lr=lr, weight_decay=weight_decay,
                                          master=master)
                      for where in groups}
        self.names = {where: {kind: [n for n, _ in members[(where, kind)]] for kind in ("muon", "adamw")}
                      for where in groups}
        self.device = device
        self.clip_layers = dict(sorted(attention_layers.items()))
        self.qk_clip = (QKClip(attention_layers=list(self.clip_layers.values()), tau=tau)
                        if tau is not None and self.clip_layers else None)
        self.last_clip: ClipStats | None = None
        if master:  # the fp32 masters were taken above; the weights become bf16, gradients accumulate in fp32
            params = self._all_params()
            for p in params:
                p.data = p.data.to(param_dtype)
            accumulate_in_fp32(params)
        # After accumulate_in_fp32: hooks run in registration order, so the bucket hooks see the fp32 sum.
        self.reducers = self._reducers(groups, [p for _, p in named_params], overlap_grad_reduce, grad_bucket_numel,
                                       reduce_groups)

    def _reducers(self, groups: dict[str, ProcessGroup], order: list[nn.Parameter], overlap: bool, cap: int,
                  reduce_groups: dict[str, ProcessGroup] | None) -> dict[str, GradBuckets]:
        if overlap and dist.is_initialized() and reduce_groups is None:
            if groups["dense"] is not None or groups["expert"] is not None:
                raise ValueError("overlap_grad_reduce over sub-groups needs reduce_groups (dedicated_groups)")
            reduce_groups = {where: dist.new_group() for where in groups}  # every rank builds both, in order
        out = {}
        for where, group in groups.items():
            hooks = overlap and group_size(group) > 1
            if hooks and not same_ranks(reduce_groups[where], group):
                raise ValueError(f"reduce_groups[{where!r}] must hold the same ranks as the {where} group")
            out[where] = GradBuckets([self.muon[where], self.adamw[where]], order,
                                     reduce_groups[where] if hooks else group, cap, hooks)
        return out

    def arm_overlap(self, fires: int = 1) -> None:
        """Before the step's last backward (pipeline: before the step, `fires` = micro-batches): reduce each
        gradient bucket from backward hooks once its parameters have accumulated `fires` more gradients
        (a no-op without overlap_grad_reduce)."""
        for reducer in self.reducers.values():
            if reducer.hooked:
                reducer.arm(fires)

    def overlap_stats(self) -> OverlapStats:
        """Buckets issued from hooks, early, and at drain, summed over both groups since construction."""
        total = OverlapStats()
        for r in self.reducers.values():
            total.hook += r.stats.hook
            total.early += r.stats.early
            total.drain += r.stats.drain
            total.last = (total.last[0] + r.stats.last[0], total.last[1] + r.stats.last[1])
        return total

    # ------------------------------------------------------------------------------------------ MuonClip API
    def set_lr(self, lr: float) -> None:
        self.lr = lr
        for part in self.adamw.values():
            part.set_lr(lr)

    def _all_params(self) -> list[nn.Parameter]:
        return [p for part in (*self.muon.values(), *self.adamw.values()) for p in part.params]

    def zero_grad(self) -> None:
        for reducer in self.reducers.values():  # a skipped step's buckets: finish them so every rank's
            if reducer.in_progress:               # collectives stay matched, then drop the result
                reducer.drain()
        for part in self.muon.values():
            part.grads = {}
        for part in self.adamw.values():
            for m in part.masters:
                m.grad = None
        for p in self._all_params():
            p.grad = None
        clear_fp32_grads(self._all_params())

    def skip_step(self) -> None:
        """Drop a step's gradients without updating (a bad loss or gradient norm; its max logits are the caller's)."""
        self.zero_grad()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum every gradient over its replication group onto the rank(s) that update it (with overlap, what the
        backward hooks have not issued yet, then wait for all); frees `p.grad`."""
        for where, reducer in self.reducers.items():
            self.muon[where].grads = {}  # the owners' sums land in it as the buckets finish
            reducer.drain()
        for p in self._all_params():
            p.grad = None
        clear_fp32_grads(self._all_params())

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm over all ranks (each element counted once); clip to max_norm if > 0."""
        square = torch.zeros((), dtype=torch.float32, device=self.device)
        for part in (*self.muon.values(), *self.adamw.values()):
            square += part.grad_square_sum().to(self.device)
        if dist.is_initialized():
            with comm_clock.timed():
                dist.all_reduce(square)  # every reduced gradient element lives on exactly one rank
        norm = float(square.sqrt())
        if max_norm > 0:
            coef = min(1.0, max_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
            for part in (*self.muon.values(), *self.adamw.values()):
                part.scale_gradients(coef)
        return norm

    @torch.no_grad()
    def step(self, max_logits: torch.Tensor | None = None) -> ClipStats:
        """Muon and AdamW updates of every replica, then QK-Clip with max logits MAX-reduced over all ranks
        (with fp32 masters, the clip is multiplied into the masters before the rounded weights go out)."""
        max_logits = self._reduced_max_logits(max_logits)
        clip = None
        if self.param_dtype != torch.float32 and self.tau is not None:
            clip = clip_factors(self.clip_layers, max_logits, self.tau)
        for part in self.muon.values():
            part.step(self.lr, self.weight_decay, clip)
        for part in self.adamw.values():
            part.step(clip)
        if clip is None and self.qk_clip is not None:
            self.qk_clip.apply(max_logits[list(self.clip_layers)], reduce=False)
        gamma = torch.ones_like(max_logits)
        if self.tau is not None:
            gamma = torch.where(max_logits > self.tau, self.tau / max_logits, gamma)
        self.last_clip = ClipStats(max_logits=max_logits, gamma=gamma)
        return self.last_clip

    def _reduced_max_logits(self, max_logits: torch.Tensor | None) -> torch.Tensor:
        if max_logits is None:  # no forward recorded any: nothing is clipped
            max_logits = unrecorded_max_logits(self.model.config)
        with comm_clock.timed():
            return reduce_max_logits(max_logits.to(self.device)).cpu()  # NCCL reduces device tensors only

    # ------------------------------------------------------------------------------------------ state
    def state_bytes(self) -> int:
        """Optimizer-state bytes on this rank: owned Muon momentum, AdamW master and moment shards."""
        return sum(part.state_bytes() for part in (*self.muon.values(), *self.adamw.values()))

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The persistent tensors this rank's optimizer holds, by role: fp32 masters and optimizer state
        (for held.py's storage count; momentum of owned Muon matrices, AdamW moments)."""
        master = [m for part in self.adamw.values() for m in part.masters]
        master += [m for part in self.muon.values() for m in part.masters.values()]
        moments = [t for part in self.adamw.values() for m in part.masters for t in part.adamw.state[m].values()]
        momentum = [b for part in self.muon.values() for b in part.buffers.values()]
        return {"master": master, "optimizer": momentum + moments}

    def _layout(self) -> dict[str, Any]:
        return {where: {"muon": [(u.index, u.start, u.stop, u.owner) for u in self.muon[where].units],
                        "adamw": [list(r) for r in self.adamw[where].ranges], "names": self.names[where]}
                for where in self.muon}

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (one file per rank; checkpoints use dcp_state's layout-free names)."""
        return {"layout": self._layout(), "tau": self.tau,
                "momentum": {where: [b.clone() for b in part.buffers.values()] for where, part in self.muon.items()},
                "adamw": {where: [{k: ShardedAdamW.local(v).clone() for k, v in part.adamw.state[m].items()}
                                  for m in part.masters] for where, part in self.adamw.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned on the same rank of the same layout."""
        if state["layout"] != self._layout():
            raise ValueError("optimizer state was saved with a different parallel layout or model "
                             "(resume with the same parallel.dp/ep/pp and model shapes)")
        for where, part in self.muon.items():
            for live, saved in zip(part.buffers.values(), state["momentum"][where], strict=True):
                live.copy_(saved)
        for where, part in self.adamw.items():
            for m, saved in zip(part.masters, state["adamw"][where], strict=True):
                for k, v in saved.items():
                    ShardedAdamW.local(part.adamw.state[m][k]).copy_(v)


def build_optimizer(model: nn.Module, expert_names: frozenset[str], mesh: ParallelMesh,
                    muonclip_kwargs: dict[str, Any]) -> DistributedMuonClip:
    """The parallel trainer's optimizer for this rank's share (`OptimSection.muonclip_kwargs()` as keywords):
    dense weights replicated over the "data" group, routed experts over "dp"; `parallel.param_dtype` weights
    (bfloat16: cast here, after the fp32 masters are taken)."""
    agree_ns_kernel(next(model.parameters()).device, muonclip_kwargs.get("ns_dtype", torch.bfloat16))
    overlap = mesh.config.overlap_grad_reduce and mesh.mesh is not None
    if isinstance(model, PipelineModel):
        named, attention = model.named_full_parameters(), model.attention
    else:
        named, attention = list(model.named_parameters()), dict(enumerate(model.attention_layers()))
    return DistributedMuonClip(model, named, attention, **muonclip_kwargs, expert_names=expert_names,
                               dense_group=mesh.group("data"), expert_group=mesh.group("dp"),
                               param_dtype=PARAM_DTYPES[mesh.config.param_dtype], overlap_grad_reduce=overlap,
                               grad_bucket_numel=mesh.config.grad_bucket_numel,
                               reduce_groups=dedicated_groups(mesh) if overlap else None)


def agree_ns_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """Rank 0 measures the Newton-Schulz kernel (optim/ns_kernel.py) and every rank pins its choice, so a run's
    numerics do not depend on which rank happened to be slowed down while timing; returns the kernel."""
    kernel = select_ns_kernel(device, dtype) if not dist.is_initialized() or dist.get_rank() == 0 else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [kernel]
        dist.broadcast_object_list(box, src=0)
        kernel = box[0]
    pin_ns_kernel(device, dtype, kernel)
    return kernel
