"""Distributed Muon over one replication group: every matrix is orthogonalised once, by its owner.

One step for the group's Muon matrices (owners: owners.py, balanced by Newton-Schulz FLOPs):

1. gradients: grad_hooks.py cuts the parameters into buckets (in reverse registration order, the order backward
   finishes them); `reduce_bucket` packs a bucket's matrices by owner and `dist.reduce`s each pack to its owner
   (sum, async); only the owner keeps the summed gradient, everyone frees `p.grad`. `reduce_gradients` does
   all buckets at once (DistributedMuonClip drives the buckets itself, from backward hooks when overlapping);
2. `step`: the owner runs Muon's momentum (`optim.muon.muon_momentum`; the fp32 buffer lives on the owner only)
   and Newton-Schulz on its matrices, batched by (small side, large side) as single-process Muon does;
3. the orthogonalised directions O are broadcast from each owner in `update_dtype` (bf16 by default: with a
   bf16 Newton-Schulz, O already holds bf16 values, so this is lossless) and every replica, the owner included,
   applies the same `optim.muon.apply_muon_update` to its weights, so replicas stay bit-identical.

With a group of one rank (routed experts under EP with dp = 1) nothing is communicated.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from openk2.optim.muon import apply_muon_update, muon_momentum, zeropower_via_newtonschulz5
from openk2.train.parallel import comm_clock
from openk2.train.parallel.grad_hooks import GradBuckets, Pending
from openk2.train.parallel.mixed import clear_fp32_grads, grad_of
from openk2.train.parallel.owners import Unit, assign_owners

DEFAULT_BUCKET_NUMEL = 1 << 24  # 64 MB of fp32 per collective


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in `group` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def _buckets(units: list[Unit], params: list[nn.Parameter], cap: int) -> Iterator[list[Unit]]:
    """Consecutive runs of `units` of at most `cap` elements (a larger unit is a bucket of its own)."""
    run: list[Unit] = []
    size = 0
    for unit in units:
        numel = unit.view(params[unit.index]).numel()
        if run and size + numel > cap:
            yield run
            run, size = [], 0
        run.append(unit)
        size += numel
    if run:
        yield run


class _InFlight:
    """Asynchronous bucket collectives with at most `limit` elements outstanding; `done(owner, run, flat)`
    handles each finished bucket in issue order, after which its buffer is dropped."""

    def __init__(self, limit: int, done: Callable[[int, list[Unit], torch.Tensor], None]) -> None:
        self.limit, self.done = limit, done
        self.queue: deque = deque()
        self.numel = 0

    def add(self, owner: int, run: list[Unit], flat: torch.Tensor, work) -> None:
        self.queue.append((owner, run, flat, work))
        self.numel += flat.numel()
        while self.numel > self.limit and len(self.queue) > 1:
            self._finish()

    def _finish(self) -> None:
        owner, run, flat, work = self.queue.popleft()
        work.wait()
        self.numel -= flat.numel()
        self.done(owner, run, flat)

    def drain(self) -> None:
        while self.queue:
            self._finish()


class DistributedMuon:
    """Muon for `params` (2-D matrices and 3-D expert stacks) replicated over `group`."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup | None, *, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, rms_scale: float = 0.2,
                 ns_dtype: torch.dtype = torch.bfloat16, update_dtype: torch.dtype | None = None,
                 bucket_numel: int = DEFAULT_BUCKET_NUMEL, master: bool = False) -> None:
        for p in params:
            if p.ndim not in (2, 3):
                raise ValueError(f"Muon takes 2-D matrices and 3-D expert stacks, got shape {tuple(p.shape)}")
        self.params, self.group = params, group
        self.size, self.rank = group_size(group), group_rank(group)
        self.momentum, self.nesterov, self.ns_steps = momentum, nesterov, ns_steps
        self.rms_scale, self.ns_dtype = rms_scale, ns_dtype
        self.update_dtype = update_dtype or ns_dtype
        self.bucket_numel = bucket_numel
        self.units = assign_owners([tuple(p.shape) for p in params], self.size, ns_steps)
        self.by_owner: dict[int, list[Unit]] = defaultdict(list)
        self.units_of: dict[int, list[Unit]] = defaultdict(list)
        for unit in self.units:
            self.by_owner[unit.owner].append(unit)
            self.units_of[unit.index].append(unit)
        self.owned = self.by_owner.get(self.rank, [])
        # fp32 momentum of the owned units only: the group's optimizer state, split ~1/size.
        self.buffers = {u: torch.zeros(u.view(params[u.index]).shape, dtype=torch.float32,
                                       device=params[u.index].device) for u in self.owned}
        self.grads: dict[Unit, torch.Tensor] = {}
        # master=True (bf16 weights): the owner keeps an fp32 copy of its units, taken from the weights now
        # (before they are cast), updates it, and the rounded weights travel instead of the directions.
        self.masters = {u: u.view(params[u.index]).detach().float().clone() for u in self.owned} if master else {}

    def _global(self, owner: int) -> int:
        return dist.get_global_rank(self.group, owner) if self.group is not None else owner

    # ------------------------------------------------------------------------------------------ gradients
    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum each matrix's gradient over the group onto its owner; frees every `p.grad`."""
        self.grads = {}
        GradBuckets([self], self.params, self.group, self.bucket_numel, hooks=False).drain()
        for p in self.params:
            p.grad = None
        clear_fp32_grads(self.params)

    def reduce_bucket(self, indices: list[int], group: dist.ProcessGroup | None) -> list[Pending]:
        """Issue the sums of params[i]'s gradients (i in `indices`) onto their owners over `group` (this group's
        ranks; one async `dist.reduce` per owner); the owner's part lands in `grads` once finished."""
        units = [u for i in indices for u in self.units_of[i]]
        if self.size == 1:
            self.grads.update((u, self._grad(u)) for u in units)
            return []
        pending: list[Pending] = []
        for owner in sorted({u.owner for u in units}):
            run = [u for u in units if u.owner == owner]
            flat = torch.cat([self._grad(u).reshape(-1) for u in run])
            work = dist.reduce(flat, dst=self._global(owner), group=group, async_op=True)
            pending.append((work, partial(self._keep, owner, run, flat)))
        return pending

    def _keep(self, owner: int, run: list[Unit], flat: torch.Tensor) -> None:
        if owner == self.rank:
            self.grads.update(zip(run, self._split(flat, run), strict=True))

    def _grad(self, unit: Unit) -> torch.Tensor:
        p = self.params[unit.index]
        g = grad_of(p)
        if g is None:  # a parameter no forward reached (an idle expert stack): zero gradient
            return torch.zeros(unit.view(p).shape, dtype=torch.float32, device=p.device)
        return unit.view(g).float()

    def _split(self, flat: torch.Tensor, run: list[Unit]) -> list[torch.Tensor]:
        shapes = [unit.view(self.params[unit.index]).shape for unit in run]
        parts = flat.split([s.numel() for s in shapes])
        return [part.view(shape) for part, shape in zip(parts, shapes, strict=True)]

    def grad_square_sum(self) -> torch.Tensor:
        """Sum of squares of the owned reduced gradients (each matrix counted on one rank only)."""
        total = torch.zeros((), dtype=torch.float32, device=self._device())
        for g in self.grads.values():
            total += g.square().sum()
        return total

    def scale_gradients(self, coef: float) -> None:
        for g in self.grads.values():
            g.mul_(coef)

    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    # ------------------------------------------------------------------------------------------ update
    @torch.no_grad()
    def step(self, lr: float, weight_decay: float, clip: dict[int, torch.Tensor] | None = None) -> None:
        """Owners orthogonalise their matrices; the directions travel back; every replica updates its weights.
        With masters, owners update them (then multiply in QK-Clip's factors `clip`, id(param) -> factor) and
        the rounded weights travel instead."""
        ortho = self._orthogonalise_owned()
        if self.masters:
            self._step_masters(ortho, lr, weight_decay, clip or {})
            self.grads = {}
            return
        applying = [0.0]  # seconds spent updating weights while broadcasts are in flight (not communication)

        def apply(owner: int, run: list[Unit], flat: torch.Tensor | None) -> None:
            start = time.perf_counter()
            for unit, o in zip(run, [ortho[u] for u in run] if flat is None else self._split(flat, run), strict=True):
                p = self.params[unit.index]
                apply_muon_update([unit.view(p)], [o.float()], lr=lr, weight_decay=weight_decay,
                                  rms_scale=self.rms_scale, shape=tuple(p.shape))
            applying[0] += time.perf_counter() - start
        if self.size == 1:
            apply(0, self.owned, None)
        else:
            start = time.perf_counter()
            in_flight = _InFlight(2 * self.bucket_numel, apply)
            for owner in sorted(self.by_owner):
                for run in _buckets(self.by_owner[owner], self.params, self.bucket_numel):
                    if owner == self.rank:  # the owner applies the same rounded update as everyone else
                        flat = torch.cat([ortho[u].reshape(-1).to(self.update_dtype) for u in run])
                    else:
                        numel = sum(u.view(self.params[u.index]).numel() for u in run)
                        flat = torch.empty(numel, dtype=self.update_dtype, device=self._device())
                    in_flight.add(owner, run, flat, dist.broadcast(flat, src=self._global(owner), group=self.group,
                                                                   async_op=True))
            in_flight.drain()
            comm_clock.add(time.perf_counter() - start - applying[0])
        self.grads = {}

    def _step_masters(self, ortho: dict[Unit, torch.Tensor], lr: float, weight_decay: float,
                      clip: dict[int, torch.Tensor]) -> None:
        for u in self.owned:
            p, m = self.params[u.index], self.masters[u]
            apply_muon_update([m], [ortho[u]], lr=lr, weight_decay=weight_decay, rms_scale=self.rms_scale,
                              shape=tuple(p.shape))
            if id(p) in clip:
                m.mul_(u.view(clip[id(p)]))

        def install(owner: int, run: list[Unit], flat: torch.Tensor) -> None:
            for unit, w in zip(run, self._split(flat, run), strict=True):
                unit.view(self.params[unit.index]).copy_(w)
        if self.size == 1:
            for u in self.owned:
                u.view(self.params[u.index]).copy_(self.masters[u])
            return
        dtype = self.params[0].dtype
        with comm_clock.timed():
            in_flight = _InFlight(2 * self.bucket_numel, install)
            for owner in sorted(self.by_owner):
                for run in _buckets(self.by_owner[owner], self.params, self.bucket_numel):
                    if owner == self.rank:  # the owner installs the same rounded weights as everyone else
                        flat = torch.cat([self.masters[u].reshape(-1).to(dtype) for u in run])
                    else:
                        numel = sum(u.view(self.params[u.index]).numel() for u in run)
                        flat = torch.empty(numel, dtype=dtype, device=self._device())
                    in_flight.add(owner, run, flat, dist.broadcast(flat, src=self._global(owner), group=self.group,
                                                                   async_op=True))
            in_flight.drain()

    def _orthogonalise_owned(self) -> dict[Unit, torch.Tensor]:
        """Momentum + Newton-Schulz for the owned units, one batch per (small, large) shape; fp32 results."""
        by_shape: dict[tuple[int, int], list[Unit]] = defaultdict(list)
        for u in self.owned:
            n, m = self.params[u.index].shape[-2:]
            by_shape[(min(n, m), max(n, m))].append(u)
        out: dict[Unit, torch.Tensor] = {}
        for (small, big), units in by_shape.items():
            grads = [self.grads.get(u, torch.zeros_like(self.buffers[u])) for u in units]
            directions = muon_momentum([self.buffers[u] for u in units], grads, self.momentum,
                                       nesterov=self.nesterov)
            # Tall matrices join the batch transposed (Newton-Schulz iterates on the wide orientation).
            wide = [(d if d.shape[-2] <= d.shape[-1] else d.mT).reshape(-1, small, big) for d in directions]
            ortho = zeropower_via_newtonschulz5(torch.cat(wide), self.ns_steps, self.ns_dtype).float()
            counts = [w.shape[0] for w in wide]
            for unit, d, part in zip(units, directions, ortho.split(counts), strict=True):
                tall = d.shape[-2] > d.shape[-1]
                part = part.mT if tall else part
                out[unit] = part.reshape(d.shape) if d.ndim == 3 else part[0]
        return out

    # ------------------------------------------------------------------------------------------ state
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds for the group (its owned momentum and fp32 masters)."""
        return sum(b.numel() * b.element_size() for b in (*self.buffers.values(), *self.masters.values()))
