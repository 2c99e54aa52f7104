"""ZeRO-1 data parallelism with distributed Muon and QK-Clip: the optimizer a parallel run steps.

Every rank holds full (replicated) weights; optimizer state is split. The parameters of one replication group
are laid end to end in a flat buffer (`FlatShard`) and rank r of that group owns the slice [r*S, (r+1)*S).
One step (Moonlight, arXiv:2502.16982, section 2.3, "Distributed Muon"):

1. reduce-scatter the gradients: each rank receives the summed gradient of its slice only;
2. AdamW parameters: update the slice (AdamW is elementwise, so a slice update is exact);
3. Muon parameters: update the momentum slice, all-gather the momentum-updated (Nesterov) slices into full
   matrices, orthogonalise each matrix that overlaps this rank's slice, apply only the slice;
4. all-gather the updated slices into the replicated weights;
5. QK-Clip with the per-head max logits MAX-reduced over all ranks (K2 report, Algorithm 1).

Two replication groups exist: dense weights are replicated over every rank that reads its own tokens (dp x ep,
"data"), routed-expert weights only over "dp" (each ep rank holds different experts).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from openk2.optim.muon import apply_muon_update, muon_momentum, zeropower_via_newtonschulz5
from openk2.optim.muonclip import ClipStats
from openk2.optim.param_groups import ADAMW_BETAS, ADAMW_EPS, MuonFilter, default_muon_filter
from openk2.optim.qk_clip import QKClip, reduce_max_logits, unrecorded_max_logits

ProcessGroup = dist.ProcessGroup | None


def _group_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _group_rank(group: ProcessGroup) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


@dataclass(frozen=True)
class _Piece:
    """The part of parameter `index` that falls in this rank's slice: param elements [start, stop)."""

    index: int
    start: int
    stop: int
    shard_offset: int


def shard_pieces(numels: list[int], group_size: int, group_rank: int) -> list[_Piece]:
    """The parts of tensors of `numels` elements, laid end to end, in rank `group_rank`'s equal slice."""
    size = math.ceil(sum(numels) / group_size)
    lo, offset, pieces = group_rank * size, 0, []
    for i, numel in enumerate(numels):
        start, stop = max(lo, offset) - offset, min(lo + size, offset + numel) - offset
        if start < stop:
            pieces.append(_Piece(i, start, stop, offset + start - lo))
        offset += numel
    return pieces


class FlatShard:
    """Parameters laid end to end in one flat fp32 buffer; this rank of `group` owns elements [lo, lo + size)."""

    def __init__(self, params: list[nn.Parameter], group: ProcessGroup) -> None:
        self.params, self.group = params, group
        self.group_size, self.group_rank = _group_size(group), _group_rank(group)
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]
        self.size = math.ceil(self.numel / self.group_size)  # the last slice is padded with zeros
        self.pieces = shard_pieces([p.numel() for p in params], self.group_size, self.group_rank)

    def local(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """This rank's slice of the concatenation of `tensors` (one per parameter; None = zeros), fp32."""
        out = torch.zeros(self.size, dtype=torch.float32, device=self.params[0].device)
        for piece in self.pieces:
            t = tensors[piece.index]
            if t is not None:
                out[piece.shard_offset:piece.shard_offset + piece.stop - piece.start] = (
                    t.detach().reshape(-1)[piece.start:piece.stop])
        return out

    def reduce_scatter(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """Sum `tensors` (e.g. gradients) over the group; return this rank's slice of the sum."""
        if self.group_size == 1:
            return self.local(tensors)
        device = self.params[0].device
        parts = [(t if t is not None else torch.zeros_like(p)).detach().reshape(-1).float()
                 for t, p in zip(tensors, self.params, strict=True)]
        padding = self.size * self.group_size - self.numel
        flat = torch.cat([*parts, torch.zeros(padding, device=device)])
        out = torch.empty(self.size, dtype=torch.float32, device=device)
        dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's slice: the full flat buffer (with padding at the end)."""
        if self.group_size == 1:
            return shard
        out = torch.empty(self.size * self.group_size, dtype=shard.dtype, device=shard.device)
        dist.all_gather_single(out, shard.contiguous(), group=self.group)
        return out

    def full_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter `index`'s part of a full flat buffer, shaped like the parameter."""
        return flat[self.offsets[index]:self.offsets[index + 1]].view(self.params[index].shape)

    @torch.no_grad()
    def write_params(self, flat: torch.Tensor) -> None:
        """Copy a full flat buffer (from all_gather) into the parameters."""
        for i, p in enumerate(self.params):
            p.copy_(self.full_view(flat, i))

    def layout(self) -> dict[str, Any]:
        """What a saved shard must match to be loaded back."""
        return {"numel": self.numel, "group_size": self.group_size, "group_rank": self.group_rank,
                "shapes": [list(p.shape) for p in self.params]}


@dataclass
class _Bucket:
    """One FlatShard and how its parameters are updated ("muon" or "adamw")."""

    name: str
    kind: str
    shard: FlatShard
    grad: torch.Tensor | None = None  # this rank's reduced gradient slice, between reduce and step


class ZeroMuonClip:
    """MuonClip (Muon + AdamW + QK-Clip) with ZeRO-1 sharded state; the trainer's optimizer in parallel runs.

    `named_params` are this rank's (full-model name, parameter) pairs; `expert_names` those replicated only
    over `expert_group`, the rest are replicated over `dense_group`. `attention_layers` maps this rank's
    global layer index to its attention module (for QK-Clip); `model` supplies the max-logit probe.
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
    ) -> None:
        self.model = model
        self.lr, self.weight_decay, self.tau = lr, weight_decay, tau
        self.momentum, self.nesterov, self.ns_steps = momentum, nesterov, ns_steps
        self.rms_scale, self.ns_dtype = rms_scale, ns_dtype
        keep = muon_filter or default_muon_filter
        members: dict[tuple[str, str], list[nn.Parameter]] = defaultdict(list)
        for name, p in named_params:
            if not p.requires_grad:
                continue
            kind = "muon" if use_muon and keep(name, p) else "adamw"
            members[("expert" if name in expert_names else "dense", kind)].append(p)
        groups = {"dense": dense_group, "expert": expert_group}
        self.buckets = [_Bucket(f"{where}/{kind}", kind, FlatShard(params, groups[where]))
                        for (where, kind), params in sorted(members.items())]
        self.momentum_buffers = {b.name: torch.zeros(b.shard.size, device=b.shard.params[0].device)
                                 for b in self.buckets if b.kind == "muon"}
        # AdamW runs on one flat parameter per bucket: this rank's slice, refreshed from the weights each step.
        self.adam_slices = {b.name: nn.Parameter(torch.zeros(b.shard.size, device=b.shard.params[0].device))
                            for b in self.buckets if b.kind == "adamw"}
        self.adamw = torch.optim.AdamW(list(self.adam_slices.values()), lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS,
                                       weight_decay=weight_decay) if self.adam_slices else None
        self.clip_layers = dict(sorted(attention_layers.items()))
        self.qk_clip = (QKClip(attention_layers=list(self.clip_layers.values()), tau=tau)
                        if tau is not None and self.clip_layers else None)
        self.last_clip: ClipStats | None = None

    # ------------------------------------------------------------------------------------------ MuonClip API
    def set_lr(self, lr: float) -> None:
        self.lr = lr
        if self.adamw is not None:
            for group in self.adamw.param_groups:
                group["lr"] = lr

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.grad = None
            for p in b.shard.params:
                p.grad = None

    def skip_step(self) -> None:
        """Drop a step's gradients without updating (a bad loss or gradient norm; its max logits are the caller's)."""
        self.zero_grad()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum every bucket's gradients over its group, keeping this rank's slice; frees the full gradients."""
        for b in self.buckets:
            b.grad = b.shard.reduce_scatter([p.grad for p in b.shard.params])
            for p in b.shard.params:
                p.grad = None

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm over all ranks' slices (each element counted once); clip to max_norm if > 0."""
        assert all(b.grad is not None for b in self.buckets), "call reduce_gradients() first"
        device = self.buckets[0].grad.device
        square = sum((b.grad.square().sum() for b in self.buckets), torch.zeros((), device=device))
        if dist.is_initialized():
            dist.all_reduce(square)  # every slice of every group lives on exactly one rank
        norm = float(square.sqrt())
        if max_norm > 0:
            coef = min(1.0, max_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
            for b in self.buckets:
                b.grad.mul_(coef)
        return norm

    @torch.no_grad()
    def step(self, max_logits: torch.Tensor | None = None) -> ClipStats:
        """Update every slice, all-gather the weights, then QK-Clip with max logits MAX-reduced over all ranks."""
        for b in self.buckets:
            assert b.grad is not None, "call reduce_gradients() first"
            values = b.shard.local([p.detach() for p in b.shard.params])
            if b.kind == "muon":
                self._muon_update(b, values)
            else:
                values = self._adamw_update(b, values)
            b.shard.write_params(b.shard.all_gather(values))
            b.grad = None
        return self._qk_clip(max_logits)

    def _adamw_update(self, b: _Bucket, values: torch.Tensor) -> torch.Tensor:
        slice_param = self.adam_slices[b.name]
        slice_param.copy_(values)  # QK-Clip edits weights after each step, so re-read them
        slice_param.grad = b.grad
        self.adamw.step()  # elementwise, so stepping slices one at a time equals the single-process update
        slice_param.grad = None
        return slice_param.detach()

    def _muon_update(self, b: _Bucket, values: torch.Tensor) -> None:
        """Muon's rule (openk2.optim.muon) on this rank's slice; only Newton-Schulz sees the full matrices."""
        (direction,) = muon_momentum([self.momentum_buffers[b.name]], [b.grad], self.momentum,
                                     nesterov=self.nesterov)
        full = b.shard.all_gather(direction)
        for piece, ortho in self._orthogonalise_overlapping(b.shard, full):
            target = values[piece.shard_offset:piece.shard_offset + piece.stop - piece.start]
            apply_muon_update([target], [ortho.reshape(-1)[piece.start:piece.stop]], lr=self.lr,
                              weight_decay=self.weight_decay, rms_scale=self.rms_scale,
                              shape=b.shard.params[piece.index].shape)

    def _orthogonalise_overlapping(self, shard: FlatShard, full: torch.Tensor):
        """Newton-Schulz on each full matrix that overlaps this rank's slice, batched by shape."""
        by_shape: dict[tuple[int, ...], list[_Piece]] = defaultdict(list)
        for piece in shard.pieces:
            by_shape[tuple(shard.params[piece.index].shape[-2:])].append(piece)
        for pieces in by_shape.values():
            mats = [shard.full_view(full, piece.index) for piece in pieces]
            counts = [m.shape[0] if m.ndim == 3 else 1 for m in mats]
            stacked = torch.cat([m.reshape(-1, *m.shape[-2:]) for m in mats])
            ortho = zeropower_via_newtonschulz5(stacked, self.ns_steps, self.ns_dtype).float()
            for piece, part in zip(pieces, ortho.split(counts), strict=True):
                yield piece, part

    def _qk_clip(self, max_logits: torch.Tensor | None) -> ClipStats:
        device = self.buckets[0].shard.params[0].device  # NCCL reduces device tensors only
        # Over the whole world: data ranks saw different tokens, pipeline stages filled different layers.
        if max_logits is None:  # no forward recorded any: nothing is clipped
            max_logits = unrecorded_max_logits(self.model.config)
        max_logits = reduce_max_logits(max_logits.to(device)).cpu()
        gamma = torch.ones_like(max_logits)
        if self.tau is not None:
            gamma = torch.where(max_logits > self.tau, self.tau / max_logits, gamma)
        if self.qk_clip is not None:
            self.qk_clip.apply(max_logits[list(self.clip_layers)], reduce=False)
        self.last_clip = ClipStats(max_logits=max_logits, gamma=gamma)
        return self.last_clip

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This rank's slices of the optimizer state (save one file per rank)."""
        return {
            "layout": {b.name: b.shard.layout() for b in self.buckets},
            "momentum": {k: v.clone() for k, v in self.momentum_buffers.items()},
            "adamw": None if self.adamw is None else self.adamw.state_dict(),
            "tau": self.tau,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore slices saved by the same rank of the same parallel layout."""
        layout = {b.name: b.shard.layout() for b in self.buckets}
        if state["layout"] != layout:
            raise ValueError("optimizer shard was saved with a different parallel layout or model "
                             "(resume with the same parallel.dp/ep/pp and model shapes)")
        for name, buf in state["momentum"].items():
            self.momentum_buffers[name].copy_(buf)
        if self.adamw is not None:
            self.adamw.load_state_dict(state["adamw"])
