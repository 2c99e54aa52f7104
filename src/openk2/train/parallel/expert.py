"""Expert parallelism: routed experts split over the "ep" ranks, tokens moved with autograd all-to-all.

Each ep rank reads its own tokens, routes them, and sends every (token, slot) row to the rank holding the
chosen expert (dispatch); that rank runs its experts' grouped matmul on what it received and sends the
outputs back (combine), where they are weighted and summed per token as on one device. Both exchanges are
the autograd-aware functional `all_to_all_single_autograd` (what torchtitan uses; the older
torch.distributed.nn.functional form is deprecated), whose backward is the reverse all-to-all, so expert
gradients land on the expert's rank and input gradients on the token's rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from openk2.model import K2ForCausalLM
from openk2.model.moe import MoE, RoutedExperts, Routing
from openk2.train.parallel import comm_clock
from openk2.train.parallel.mesh import ParallelMesh

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


class ExpertParallelExperts(RoutedExperts):
    """This ep rank's slice of a RoutedExperts: experts [rank * E/ep, (rank + 1) * E/ep), same parameter names
    (sliced from the full weights; from a meta-built model the slice is meta too, and nothing is allocated)."""

    def __init__(self, experts: RoutedExperts, group: dist.ProcessGroup, ep_rank: int, ep_size: int) -> None:
        nn.Module.__init__(self)
        self.num_experts = experts.gate_proj.shape[0]
        if self.num_experts % ep_size:
            raise ValueError(f"model.n_routed_experts={self.num_experts} is not divisible by parallel.ep={ep_size}")
        self.group, self.ep_size = group, ep_size
        self.num_local = self.num_experts // ep_size
        self.expert_offset = ep_rank * self.num_local  # global index of the first local expert (model/init.py)
        local = slice(self.expert_offset, self.expert_offset + self.num_local)
        for name in EXPERT_WEIGHTS:
            setattr(self, name, nn.Parameter(getattr(experts, name).detach()[local].clone()))
        self.use_grouped_mm = experts.use_grouped_mm

    def forward(self, x_ND: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """Combined expert output [N, D] of this rank's tokens and their counts per (global) expert [E]."""
        n, k = routing.indices_NK.shape
        flat_experts = routing.indices_NK.reshape(-1)
        order = flat_experts.argsort(stable=True)  # rows grouped by expert, hence by destination rank
        token_of_row = order // k
        counts_E = torch.bincount(flat_experts, minlength=self.num_experts)
        dtype = torch.get_autocast_dtype(x_ND.device.type) if torch.is_autocast_enabled() else x_ND.dtype
        x_MD = x_ND[token_of_row].to(dtype)

        # Tell every rank how many rows it gets for each of its local experts: [source rank, local expert].
        received_counts = torch.empty_like(counts_E)
        with comm_clock.timed():
            dist.all_to_all_single(received_counts, counts_E, group=self.group)
        send_splits = counts_E.view(self.ep_size, self.num_local).sum(1).tolist()
        recv_splits = received_counts.view(self.ep_size, self.num_local).sum(1).tolist()
        x_recv = _all_to_all(x_MD, recv_splits, send_splits, self.group)

        # Received rows come grouped by source rank, then by local expert; the grouped matmul wants them by expert.
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.num_local, device=x_ND.device).repeat(self.ep_size), received_counts)
        by_expert = expert_of_row.argsort(stable=True)
        offsets = received_counts.view(self.ep_size, self.num_local).sum(0).cumsum(0).to(torch.int32)
        y_sorted = self.swiglu(x_recv[by_expert], offsets)
        y_recv = y_sorted[by_expert.argsort()]  # back to arrival order

        y_MD = _all_to_all(y_recv, send_splits, recv_splits, self.group)
        y_MD = y_MD * routing.weights_NK.reshape(-1)[order, None].to(y_MD.dtype)
        out = torch.zeros(n, y_MD.shape[-1], dtype=y_MD.dtype, device=y_MD.device)
        return out.index_add_(0, token_of_row, y_MD), counts_E


def _all_to_all(x_MD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    with comm_clock.timed():  # waited here, so the forward exchange is timed (its backward is not)
        return wait_tensor(all_to_all_single_autograd(x_MD.contiguous(), out_splits, in_splits, group))


def shard_experts(model: K2ForCausalLM, mesh: ParallelMesh) -> frozenset[str]:
    """Replace every MoE layer's experts by this ep rank's slice; returns the sharded parameters' names."""
    if mesh.config.ep == 1:
        return frozenset()
    names = set()
    for i, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, MoE):
            layer.mlp.experts = ExpertParallelExperts(layer.mlp.experts, mesh.group("ep"), mesh.ep_rank,
                                                      mesh.config.ep)
            names.update(f"model.layers.{i}.mlp.experts.{w}" for w in EXPERT_WEIGHTS)
    return frozenset(names)


def gather_expert_weight(local: torch.Tensor, mesh: ParallelMesh) -> torch.Tensor:
    """The full [E, ...] weight from every ep rank's [E/ep, ...] slice (all ep ranks must call it)."""
    parts = [torch.empty_like(local) for _ in range(mesh.config.ep)]
    dist.all_gather(parts, local.detach().contiguous(), group=mesh.group("ep"))
    return torch.cat(parts)
