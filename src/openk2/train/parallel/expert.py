"""Expert parallelism: routed experts split over the "ep" ranks, tokens moved by all-to-all inside autograd.

Each ep rank reads its own tokens, routes them, and sends every (token, slot) row to the rank holding the
chosen expert (dispatch); that rank runs its experts' grouped matmul on what it received and sends the
outputs back (combine), where they are weighted and summed per token as on one device. The backward of each
exchange is the reverse exchange, so expert gradients land on the expert's rank and input gradients on the
token's rank.

Overlap (`parallel.ep_overlap`): an exchange is split into an issue and a wait, two autograd nodes
(`_Issue`, `_Wait`), so the MoE layer can compute what does not depend on the routed experts (the shared
expert, the balance loss) between `begin` (dispatch issued) and `finish` (dispatch waited). Backward mirrors
it: `_Wait`'s backward issues the reverse exchange and `_Issue`'s backward waits for it. The autograd engine
runs ready nodes latest-created first, so the shared expert's backward, created between the two in the
forward, runs while the reverse dispatch is in flight. Same ops on the same values in either order: the
result is bit-identical with and without overlap (tests/train/parallel/test_ep_overlap.py). The combine has
no independent work in the layer (the residual add and the next layer need its output): not overlapped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from openk2.model import K2ForCausalLM
from openk2.model.moe import MoE, RoutedExperts, Routing
from openk2.train.parallel import comm_clock
from openk2.train.parallel.mesh import ParallelMesh

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


class ExpertParallelExperts(RoutedExperts):
    """This ep rank's slice of a RoutedExperts: experts [rank * E/ep, (rank + 1) * E/ep), same parameter names
    (sliced from the full weights; from a meta-built model the slice is meta too, and nothing is allocated)."""

    def __init__(self, experts: RoutedExperts, group: dist.ProcessGroup, ep_rank: int, ep_size: int,
                 overlap: bool = True) -> None:
        nn.Module.__init__(self)
        self.num_experts = experts.gate_proj.shape[0]
        if self.num_experts % ep_size:
            raise ValueError(f"model.n_routed_experts={self.num_experts} is not divisible by parallel.ep={ep_size}")
        self.group, self.ep_size, self.overlap = group, ep_size, overlap
        self.num_local = self.num_experts // ep_size
        self.expert_offset = ep_rank * self.num_local  # global index of the first local expert (model/init.py)
        local = slice(self.expert_offset, self.expert_offset + self.num_local)
        for name in EXPERT_WEIGHTS:
            setattr(self, name, nn.Parameter(getattr(experts, name).detach()[local].clone()))
        self.use_grouped_mm = experts.use_grouped_mm

    def forward(self, x_ND: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """Combined expert output [N, D] of this rank's tokens and their counts per (global) expert [E]."""
        counts_E, dispatched = self._dispatch(x_ND, routing)
        return self._finish(dispatched), counts_E

    def begin(self, x_ND: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """Counts per expert [E] and `finish()`; with overlap the dispatch is in flight until `finish()`."""
        if not self.overlap:
            return super().begin(x_ND, routing)
        counts_E, dispatched = self._dispatch(x_ND, routing)
        return counts_E, lambda: self._finish(dispatched)

    def _dispatch(self, x_ND: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, _Dispatched]:
        n, k = routing.indices_NK.shape
        flat_experts = routing.indices_NK.reshape(-1)
        order = flat_experts.argsort(stable=True)  # rows grouped by expert, hence by destination rank
        token_of_row = order // k
        counts_E = torch.bincount(flat_experts, minlength=self.num_experts)
        on = torch.is_autocast_enabled(x_ND.device.type)  # without a device type it reads CUDA's only
        dtype = torch.get_autocast_dtype(x_ND.device.type) if on else x_ND.dtype
        x_MD = x_ND[token_of_row].to(dtype)

        # Tell every rank how many rows it gets for each of its local experts: [source rank, local expert].
        received_counts = torch.empty_like(counts_E)
        with comm_clock.timed():
            dist.all_to_all_single(received_counts, counts_E, group=self.group)
        send_splits = counts_E.view(self.ep_size, self.num_local).sum(1).tolist()
        recv_splits = received_counts.view(self.ep_size, self.num_local).sum(1).tolist()
        flight = _Flight(self.group, recv_splits, send_splits)
        return counts_E, _Dispatched(n, order, token_of_row, received_counts, flight,
                                     _Issue.apply(x_MD.contiguous(), flight), routing.weights_NK)

    def _finish(self, d: _Dispatched) -> torch.Tensor:
        x_recv = _Wait.apply(d.in_flight, d.flight)
        # Received rows come grouped by source rank, then by local expert; the grouped matmul wants them by expert.
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.num_local, device=x_recv.device).repeat(self.ep_size), d.received_counts)
        by_expert = expert_of_row.argsort(stable=True)
        offsets = d.received_counts.view(self.ep_size, self.num_local).sum(0).cumsum(0).to(torch.int32)
        y_sorted = self.swiglu(x_recv[by_expert], offsets)
        y_recv = y_sorted[by_expert.argsort()]  # back to arrival order

        back = _Flight(self.group, d.flight.in_splits, d.flight.out_splits)
        y_MD = _Wait.apply(_Issue.apply(y_recv.contiguous(), back), back)
        y_MD = y_MD * d.weights_NK.reshape(-1)[d.order, None].to(y_MD.dtype)
        out = torch.zeros(d.n, y_MD.shape[-1], dtype=y_MD.dtype, device=y_MD.device)
        return out.index_add_(0, d.token_of_row, y_MD)


@dataclass
class _Dispatched:
    """What `finish` needs of a dispatch: the row order, the received counts and the exchange in flight."""

    n: int  # tokens on this rank
    order: torch.Tensor  # (token, slot) rows sorted by expert
    token_of_row: torch.Tensor
    received_counts: torch.Tensor  # [source rank x local expert]
    flight: _Flight
    in_flight: torch.Tensor  # the receive buffer, filled once the flight is waited
    weights_NK: torch.Tensor


class _Flight:
    """One all-to-all of rows (`in_splits` rows sent to each rank, `out_splits` received from each) and its
    reverse in backward, each started by one call and waited by another (comm_clock times both calls)."""

    def __init__(self, group: dist.ProcessGroup, out_splits: list[int], in_splits: list[int]) -> None:
        self.group, self.out_splits, self.in_splits = group, out_splits, in_splits
        self.work: dist.Work | None = None
        self.grad_in: torch.Tensor | None = None

    def start(self, x_MD: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """Issue the exchange of x's rows; returns the receive buffer (filled once `wait` returns)."""
        assert self.work is None, "an exchange is already in flight"
        out = x_MD.new_empty((sum(out_splits), *x_MD.shape[1:]))
        with comm_clock.timed():
            self.work = issue_all_to_all(out, x_MD.contiguous(), out_splits, in_splits, self.group)
        return out

    def wait(self) -> None:
        """Block until the exchange in flight has landed."""
        assert self.work is not None, "no exchange in flight"
        with comm_clock.timed():
            self.work.wait()
        self.work = None


def issue_all_to_all(out: torch.Tensor, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                     group: dist.ProcessGroup) -> dist.Work:
    """Start `dist.all_to_all_single` asynchronously (a module-level seam: the overlap test records it)."""
    return dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)


class _Issue(torch.autograd.Function):
    """Forward: start sending x's rows, return the (still filling) receive buffer. Backward: wait for the
    reverse exchange `_Wait`'s backward started, and pass its rows on as x's gradient."""

    @staticmethod
    def forward(ctx, x_MD: torch.Tensor, flight: _Flight) -> torch.Tensor:
        ctx.flight = flight
        return flight.start(x_MD, flight.out_splits, flight.in_splits)

    @staticmethod
    def backward(ctx, grad_unused: torch.Tensor) -> tuple[torch.Tensor, None]:
        flight = ctx.flight
        flight.wait()
        grad_in, flight.grad_in = flight.grad_in, None
        return grad_in, None


class _Wait(torch.autograd.Function):
    """Forward: wait for the exchange `_Issue` started and hand its rows on. Backward: start the reverse exchange
    of the gradient (its wait is `_Issue`'s backward) and pass the gradient through unchanged."""

    @staticmethod
    def forward(ctx, buffer_MD: torch.Tensor, flight: _Flight) -> torch.Tensor:
        ctx.flight = flight
        flight.wait()
        return buffer_MD.view_as(buffer_MD)

    @staticmethod
    def backward(ctx, grad_MD: torch.Tensor) -> tuple[torch.Tensor, None]:
        flight = ctx.flight
        flight.grad_in = flight.start(grad_MD.contiguous(), flight.in_splits, flight.out_splits)
        return grad_MD, None


def shard_experts(model: K2ForCausalLM, mesh: ParallelMesh) -> frozenset[str]:
    """Replace every MoE layer's experts by this ep rank's slice; returns the sharded parameters' names."""
    if mesh.config.ep == 1:
        return frozenset()
    names = set()
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, MoE):
            layer.mlp.experts = ExpertParallelExperts(layer.mlp.experts, mesh.group("ep"), mesh.ep_rank,
                                                      mesh.config.ep, mesh.config.ep_overlap)
            names.update(f"model.layers.{i}.mlp.experts.{w}" for w in EXPERT_WEIGHTS)
    return frozenset(names)


def gather_expert_weight(local: torch.Tensor, mesh: ParallelMesh) -> torch.Tensor:
    """The full [E, ...] weight from every ep rank's [E/ep, ...] slice (all ep ranks must call it)."""
    parts = [torch.empty_like(local) for _ in range(mesh.config.ep)]
    dist.all_gather(parts, local.detach().contiguous(), group=mesh.group("ep"))
    return torch.cat(parts)
