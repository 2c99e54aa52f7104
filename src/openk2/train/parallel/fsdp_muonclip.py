"""MuonClip on FSDP2's sharded parameters: each rank updates only its rows, each matrix is orthogonalised once.

Every parameter is a DTensor Shard(0) (fsdp.py: dense weights over `group`, "dp" or "data" = dp x ep when
ep > 1; this ep rank's routed experts over "dp") and its gradient arrives reduce-scattered the same way, so the
optimizer state lives on the local rows only (1/dp of the experts, 1/(dp ep) of the dense weights per rank):

- Muon momentum is elementwise: the fp32 buffer covers the rank's rows, and `optim.muon.muon_momentum` gives
  the rank's rows of the Nesterov direction.
- 3-D expert stacks [E, n, m] are sharded by experts, so a rank holds whole matrices: it orthogonalises its
  own experts, no communication.
- 2-D matrices [n, m] (all dense) are split by rows over `group`, and Newton-Schulz needs the whole matrix: each
  has one owner in `group` (owners.py, balanced by Newton-Schulz FLOPs); the ranks `gather` their direction rows
  to it, the owner
  orthogonalises its matrices (batched by shape), and `scatter`s each rank's rows of the result back.
  The peak temporary is on owners: the whole fp32 directions of the matrices a rank owns (its ~1/dp share
  of the 2-D Muon elements), the gathered copy and Newton-Schulz's batch; no step gathers everything anywhere.
- AdamW (`torch.optim.AdamW` over the DTensors) works on the local shards as they are.
- The gradient norm adds every rank's local squares over the world: each element lives on exactly one rank.
- QK-Clip: the per-head max logits are MAX-reduced over every rank (dp and ep ranks saw different tokens), so each
  rank knows every head's factor;
  it builds the per-row factor of each clipped q/k projection with QKClip's own rule on a stand-in of ones
  and multiplies its local rows by its slice of it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from openk2.optim.muon import apply_muon_update, muon_momentum, zeropower_via_newtonschulz5
from openk2.optim.muonclip import ClipStats
from openk2.optim.param_groups import ADAMW_BETAS, ADAMW_EPS, MuonFilter, default_muon_filter
from openk2.optim.qk_clip import QKClip, reduce_max_logits, unrecorded_max_logits
from openk2.train.dcp import Block
from openk2.train.dcp_state import EXP_AVG, EXP_AVG_SQ, MODEL, MOMENTUM, STEP, Entries
from openk2.train.parallel import comm_clock
from openk2.train.parallel.expert import ExpertParallelExperts
from openk2.train.parallel.fsdp import shard_rows
from openk2.train.parallel.mesh import ParallelMesh
from openk2.train.parallel.mixed import QK_PROJECTIONS, qk_stand_in
from openk2.train.parallel.owners import assign_owners
from openk2.train.parallel.pipeline import PipelineModel
from openk2.train.parallel.zero import agree_ns_kernel


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FSDPMuonClip:
    """Muon + AdamW + QK-Clip for a model sharded by `fully_shard`: dense weights over `group` ("dp", or "data"
    when ep > 1), the expert slices of `ExpertParallelExperts` modules over `expert_group` ("dp")."""

    def __init__(self, model: nn.Module, *, lr: float, weight_decay: float = 0.1, tau: float | None = 100.0,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5, rms_scale: float = 0.2,
                 ns_dtype: torch.dtype = torch.bfloat16, use_muon: bool = True,
                 muon_filter: MuonFilter | None = None, group: dist.ProcessGroup | None = None,
                 expert_group: dist.ProcessGroup | None = None) -> None:
        self.model, self.group = model, group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # parameter -> (global index of its first local row, rows of the full tensor) for expert slices
        self.expert_rows: dict[int, tuple[int, int]] = {}
        expert_size, expert_rank = dist.get_world_size(expert_group), dist.get_rank(expert_group)
        for module in model.modules():
            if isinstance(module, ExpertParallelExperts):
                for p in module.parameters(recurse=False):
                    start, _ = shard_rows(p.shape[0], expert_size, expert_rank)
                    self.expert_rows[id(p)] = (module.expert_offset + start, module.num_experts)
        self.lr, self.weight_decay, self.tau = lr, weight_decay, tau
        self.momentum, self.nesterov, self.ns_steps = momentum, nesterov, ns_steps
        self.rms_scale, self.ns_dtype = rms_scale, ns_dtype
        keep = muon_filter or default_muon_filter
        # full-model names (a PipelineModel's stage-local names renamed): what filters and checkpoints read
        named = [(n, p) for n, p in (model.named_full_parameters() if isinstance(model, PipelineModel)
                                     else model.named_parameters()) if p.requires_grad]
        muon = [(n, p) for n, p in named if use_muon and keep(n, p)]
        for n, p in muon:
            if p.ndim not in (2, 3):
                raise ValueError(f"Muon takes 2-D matrices and 3-D expert stacks, got {n} {tuple(p.shape)}")
            assert p.ndim == 3 or id(p) not in self.expert_rows, n  # expert weights are stacks: no owner needed
        self.stacks = [(n, p) for n, p in muon if p.ndim == 3]
        self.matrices = [(n, p) for n, p in muon if p.ndim == 2]
        self.owners = [u.owner for u in assign_owners([tuple(p.shape) for _, p in self.matrices], self.size,
                                                      ns_steps)]
        self.buffers = {p: torch.zeros_like(_local(p), dtype=torch.float32) for _, p in muon}
        self.adamw_params = [(n, p) for n, p in named if not (use_muon and keep(n, p))]
        # Dense and expert DTensors (two meshes) in one group: torch's AdamW steps them together, foreach too.
        self.adamw = torch.optim.AdamW([p for _, p in self.adamw_params], lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS,
                                       weight_decay=weight_decay) if self.adamw_params else None
        for _, p in self.adamw_params:  # state exists from the start, so checkpoints load into it in place
            self.adamw.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                   "exp_avg_sq": torch.zeros_like(p)}
        self.names = {id(p): n for n, p in named}
        self.qk_clip = None  # QK-Clip runs on local rows in step(); Trainer._set_tau sets `tau` directly
        self.last_clip: ClipStats | None = None

    # ------------------------------------------------------------------------------------------ MuonClip API
    def set_lr(self, lr: float) -> None:
        self.lr = lr
        if self.adamw is not None:
            for g in self.adamw.param_groups:
                g["lr"] = lr

    def _params(self) -> list[nn.Parameter]:
        return [p for _, p in (*self.stacks, *self.matrices, *self.adamw_params)]

    def zero_grad(self) -> None:
        for p in self._params():
            p.grad = None

    def skip_step(self) -> None:
        """Drop a step's gradients without updating."""
        self.zero_grad()

    def reduce_gradients(self) -> None:
        """Nothing to do: FSDP2 reduce-scattered every gradient during backward."""

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm (each element lives on one rank's shard, summed over the world); clip if > 0."""
        grads = [_local(p.grad) for p in self._params() if p.grad is not None]
        square = torch.zeros((), dtype=torch.float32, device=self._device())
        for g in grads:
            square += g.float().square().sum()
        with comm_clock.timed():
            dist.all_reduce(square)
        norm = float(square.sqrt())
        if max_norm > 0:
            coef = min(1.0, max_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
            for g in grads:
                g.mul_(coef)
        return norm

    def rows_of(self, p: nn.Parameter) -> tuple[int, int, int]:
        """(first row, stop row, rows) of this rank's rows of `p` in the full single-process tensor."""
        if id(p) in self.expert_rows:
            first, rows = self.expert_rows[id(p)]
            return first, first + _local(p).shape[0], rows
        start, stop = shard_rows(p.shape[0], self.size, self.rank)
        return start, stop, p.shape[0]

    def _device(self) -> torch.device:
        return self._params()[0].device

    @torch.no_grad()
    def step(self, max_logits: torch.Tensor | None = None) -> ClipStats:
        """Muon on the local rows (2-D matrices orthogonalised by their owner), AdamW on the shards, then QK-Clip
        on the local q/k rows with max logits MAX-reduced over all ranks."""
        self._muon_step()
        if self.adamw is not None:
            self.adamw.step()
        if max_logits is None:
            max_logits = unrecorded_max_logits(self.model.config)
        with comm_clock.timed():
            max_logits = reduce_max_logits(max_logits.to(self._device())).cpu()
        gamma = torch.ones_like(max_logits)
        if self.tau is not None:
            gamma = torch.where(max_logits > self.tau, self.tau / max_logits, gamma)
            self._clip(max_logits)
        self.last_clip = ClipStats(max_logits=max_logits, gamma=gamma)
        return self.last_clip

    # ------------------------------------------------------------------------------------------ Muon
    def _directions(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        grads = [torch.zeros_like(self.buffers[p]) if p.grad is None else _local(p.grad).float() for p in params]
        return muon_momentum([self.buffers[p] for p in params], grads, self.momentum, nesterov=self.nesterov)

    def _orthogonalise(self, directions: list[torch.Tensor]) -> list[torch.Tensor]:
        """Newton-Schulz of matrices / stacks, one batch per (small side, large side); fp32 results."""
        by_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, d in enumerate(directions):
            n, m = d.shape[-2:]
            by_shape[(min(n, m), max(n, m))].append(i)
        out: list[torch.Tensor | None] = [None] * len(directions)
        for (small, big), idx in by_shape.items():
            wide = [(directions[i] if directions[i].shape[-2] <= directions[i].shape[-1] else directions[i].mT)
                    .reshape(-1, small, big) for i in idx]
            ortho = zeropower_via_newtonschulz5(torch.cat(wide), self.ns_steps, self.ns_dtype).float()
            for i, part in zip(idx, ortho.split([w.shape[0] for w in wide]), strict=True):
                d = directions[i]
                part = part.mT if d.shape[-2] > d.shape[-1] else part
                out[i] = part.reshape(d.shape)
        return out

    def _update(self, p: nn.Parameter, ortho: torch.Tensor) -> None:
        apply_muon_update([_local(p)], [ortho], lr=self.lr, weight_decay=self.weight_decay,
                          rms_scale=self.rms_scale, shape=tuple(p.shape))

    def _muon_step(self) -> None:
        stacks = [p for _, p in self.stacks if _local(p).shape[0] > 0]  # whole local experts: no communication
        if stacks:
            for p, o in zip(stacks, self._orthogonalise(self._directions(stacks)), strict=True):
                self._update(p, o)
        matrices = [p for _, p in self.matrices]
        if not matrices:
            return
        directions = self._directions(matrices)
        full = self._gather_to_owners(matrices, directions)
        owned = sorted(full)
        orthos = dict(zip(owned, self._orthogonalise([full[i] for i in owned]), strict=True)) if owned else {}
        for p, o in zip(matrices, self._scatter_from_owners(matrices, orthos), strict=True):
            self._update(p, o)

    def _chunk_rows(self, p: nn.Parameter) -> int:
        return -(-p.shape[0] // self.size)

    def _padded(self, local: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        pad = self._chunk_rows(p) - local.shape[0]
        return torch.cat([local, local.new_zeros(pad, *local.shape[1:])]) if pad else local.contiguous()

    def _gather_to_owners(self, matrices: list[nn.Parameter],
                          directions: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each owner receives its matrices' whole direction (index -> [n, m]); the others get nothing."""
        works, received = [], {}
        with comm_clock.timed():
            for i, (p, d) in enumerate(zip(matrices, directions, strict=True)):
                owner = self.owners[i]
                chunks = None
                if owner == self.rank:
                    chunks = [d.new_empty(self._chunk_rows(p), *d.shape[1:]) for _ in range(self.size)]
                    received[i] = chunks
                works.append(dist.gather(self._padded(d, p), chunks, group=self.group, group_dst=owner,
                                         async_op=True))
            for w in works:
                w.wait()
        return {i: torch.cat(chunks)[:matrices[i].shape[0]] for i, chunks in received.items()}

    def _scatter_from_owners(self, matrices: list[nn.Parameter],
                             orthos: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's rows of each orthogonalised matrix, sent by its owner."""
        works, out = [], []
        with comm_clock.timed():
            for i, p in enumerate(matrices):
                mine = torch.empty(self._chunk_rows(p), *p.shape[1:], dtype=torch.float32, device=self._device())
                chunks = None
                if i in orthos:
                    whole = torch.cat([orthos[i], orthos[i].new_zeros(self.size * self._chunk_rows(p) - p.shape[0],
                                                                      *p.shape[1:])])
                    chunks = [c.contiguous() for c in whole.chunk(self.size)]
                works.append(dist.scatter(mine, chunks, group=self.group, group_src=self.owners[i], async_op=True))
                out.append(mine)
            for w in works:
                w.wait()
        return [o[:_local(p).shape[0]] for o, p in zip(out, matrices, strict=True)]

    # ------------------------------------------------------------------------------------------ QK-Clip
    def _clip(self, max_logits: torch.Tensor) -> None:
        """Rescale the local rows of every clipped head's q/k projections (QKClip's rule, per-row factors)."""
        layers = (self.model.attention if isinstance(self.model, PipelineModel)  # global index -> this rank's
                  else dict(enumerate(self.model.attention_layers())))
        for index, layer in layers.items():
            if not (max_logits[index] > self.tau).any():
                continue
            probe = qk_stand_in(layer, _row_shape)
            QKClip(attention_layers=[probe], tau=self.tau).apply(max_logits[index][None].float(), reduce=False)
            for name in QK_PROJECTIONS:
                real, fake = layer._modules.get(name), probe._modules.get(name)
                if real is None:
                    continue
                for key, p in real._parameters.items():
                    if p is None:
                        continue
                    start, stop = shard_rows(p.shape[0], self.size, self.rank)
                    factor = fake._parameters[key][start:stop].to(self._device())
                    _local(p).mul_(factor)

    # ------------------------------------------------------------------------------------------ state
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's persistent optimizer tensors by role (for held.py): momentum rows and AdamW moment shards."""
        moments = [_local(t) for _, p in self.adamw_params for k, t in self.adamw.state[p].items() if k != "step"]
        return {"master": [], "optimizer": [*self.buffers.values(), *moments]}

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors()["optimizer"])


def _row_shape(param: torch.Tensor) -> tuple[int, ...]:
    # one factor per row: [rows, 1] for a weight, [rows] for a bias
    return (param.shape[0], 1) if param.ndim == 2 else (param.shape[0],)


def build_fsdp_optimizer(model: nn.Module, mesh: ParallelMesh, muonclip_kwargs: dict[str, Any]) -> FSDPMuonClip:
    """The FSDP2 trainer's optimizer (`OptimSection.muonclip_kwargs()` as keywords) over the groups fsdp.py shards
    over (dense: "dp", or "data" when ep > 1; experts: "dp"), with the Newton-Schulz kernel agreed by every rank
    (zero.agree_ns_kernel)."""
    agree_ns_kernel(next(model.parameters()).device, muonclip_kwargs.get("ns_dtype", torch.bfloat16))
    dense = mesh.group("data") if mesh.config.ep > 1 else mesh.group("dp")
    return FSDPMuonClip(model, **muonclip_kwargs, group=dense, expert_group=mesh.group("dp"))


def _rows_block(local: torch.Tensor, rows: int, start: int, flat: bool) -> torch.Tensor | Block:
    """`local` as rows [start, start + len) of a tensor of `rows` rows (a DCP Block; flattened to 1-D if `flat`)."""
    full = (rows, *local.shape[1:])
    if flat:
        per_row = math.prod(full[1:])
        local, offsets, size = local.reshape(-1), (start * per_row,), (rows * per_row,)
    else:
        offsets, size = (start,) + (0,) * (len(full) - 1), full
    return local if tuple(local.shape) == tuple(size) else Block(local, offsets, size)


def fsdp_entries(model: nn.Module, optimizer: FSDPMuonClip) -> tuple[Entries, Any]:
    """The model's and optimizer's DCP entries under dcp_state's layout-free names: each rank's rows of every
    parameter, Muon momentum and AdamW moment as Blocks of the single-process tensor (expert slices at their global
    expert rows), loaded in place, so install() has nothing to do."""
    entries: Entries = {}
    rename = model.full_names if isinstance(model, PipelineModel) else {}
    for local_name, t in model.state_dict(keep_vars=True).items():
        name = rename.get(local_name, local_name)
        if isinstance(t, DTensor):
            start, stop, rows = optimizer.rows_of(t)
            if stop > start:
                entries[MODEL + name] = _rows_block(t.to_local().detach(), rows, start, flat=False)
        else:  # buffers (router biases): replicated, the same on every rank
            entries[MODEL + name] = t.detach()
    pieces = [(MOMENTUM, p, optimizer.buffers[p]) for _, p in (*optimizer.stacks, *optimizer.matrices)]
    for _, p in optimizer.adamw_params:
        state = optimizer.adamw.state[p]
        pieces += [(EXP_AVG, p, _local(state["exp_avg"])), (EXP_AVG_SQ, p, _local(state["exp_avg_sq"]))]
        entries[STEP + optimizer.names[id(p)]] = state["step"]
    for prefix, p, local in pieces:
        start, stop, rows = optimizer.rows_of(p)
        if stop > start:
            entries[prefix + optimizer.names[id(p)]] = _rows_block(local, rows, start, flat=True)
    return entries, lambda: None
