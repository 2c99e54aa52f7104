"""ZeRO-1 AdamW over one replication group with DTensor: fp32 master and moments sharded elementwise.

Each parameter is flattened to 1-D; its fp32 master is a DTensor `Shard(0)` over the group's DeviceMesh
(torch.chunk's rule: rank r holds elements [r c, (r + 1) c), c = ceil(numel / size)), so `torch.optim.AdamW`
keeps moments of the same shards. Gradients are reduce-scattered by bucket (grad_hooks.py: `reduce_bucket` lays
each rank's shards of the bucket's parameters side by side, padded to the chunk, and issues one async
reduce-scatter, sum); the updated master goes Shard(0) -> Replicate through DTensor (an all-gather, in the
weights' dtype). AdamW is elementwise, so updating shards equals the single-process update. With one rank plain
tensors are used.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from openk2.optim.param_groups import ADAMW_BETAS, ADAMW_EPS
from openk2.train.parallel import comm_clock
from openk2.train.parallel.grad_hooks import DEFAULT_GRAD_BUCKET_NUMEL, GradBuckets, Pending
from openk2.train.parallel.mixed import clear_fp32_grads, grad_of

# reduce_scatter_single is reduce_scatter_tensor's newer name (torch >= 2.13 warns on the old one).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def shard_range(numel: int, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of a 1-D tensor of `numel` elements on `rank` of `size` under DTensor's Shard(0)."""
    chunk = -(-numel // size)
    return min(numel, rank * chunk), min(numel, (rank + 1) * chunk)


class ShardedAdamW:
    """AdamW for `params` replicated over `mesh` (a 1-D DeviceMesh; None = not distributed)."""

    def __init__(self, params: list[nn.Parameter], mesh: DeviceMesh | None, *, lr: float,
                 weight_decay: float, master: bool = False) -> None:
        self.params, self.mesh = params, mesh
        self.master = master  # True (bf16 weights): the fp32 master shard is the truth, never re-read
        self.size = mesh.size() if mesh is not None else 1
        self.rank = mesh.get_local_rank() if mesh is not None else 0
        self.ranges = [shard_range(p.numel(), self.size, self.rank) for p in params]
        self.masters = [nn.Parameter(self._shard(p, r)) for p, r in zip(params, self.ranges, strict=True)]
        self.adamw = torch.optim.AdamW(self.masters, lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS,
                                       weight_decay=weight_decay) if params else None
        for m in self.masters:  # state exists from the start, so checkpoints can load into it in place
            self.adamw.state[m] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m),
                                   "exp_avg_sq": torch.zeros_like(m)}

    def _shard(self, p: torch.Tensor, rng: tuple[int, int]) -> torch.Tensor:
        local = p.detach().reshape(-1)[rng[0]:rng[1]].float().clone()
        if self.mesh is None:
            return local
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=(p.numel(),),
                                  stride=(1,))

    @staticmethod
    def local(t: torch.Tensor) -> torch.Tensor:
        """The local shard of a master, gradient or moment (itself when not a DTensor)."""
        return t.to_local() if isinstance(t, DTensor) else t

    def set_lr(self, lr: float) -> None:
        if self.adamw is not None:
            for group in self.adamw.param_groups:
                group["lr"] = lr

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group of the mesh (None when not distributed)."""
        return self.mesh.get_group() if self.mesh is not None else None

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Each master gets this rank's shard of the group-summed gradient; frees every `p.grad`."""
        GradBuckets([self], self.params, self.group, DEFAULT_GRAD_BUCKET_NUMEL, hooks=False).drain()
        for p in self.params:
            p.grad = None
        clear_fp32_grads(self.params)

    def _flat_grad(self, p: nn.Parameter) -> torch.Tensor:
        g = grad_of(p)
        return (torch.zeros(p.shape, device=p.device) if g is None else g).detach().reshape(-1).float()

    def reduce_bucket(self, indices: list[int], group: dist.ProcessGroup | None) -> list[Pending]:
        """Issue one reduce-scatter over `group` (the mesh's ranks) of params[i]'s gradients, i in `indices`:
        row r of the input holds rank r's shard of each, padded to ceil(numel / size); masters get their grad
        (this rank's shard of the sum) once finished."""
        if self.mesh is None:
            for i in indices:
                self.masters[i].grad = self._flat_grad(self.params[i])
            return []
        chunks = [-(-self.params[i].numel() // self.size) for i in indices]
        send = torch.cat([F.pad(self._flat_grad(self.params[i]), (0, self.size * c - self.params[i].numel()))
                          .view(self.size, c) for i, c in zip(indices, chunks, strict=True)], dim=1)
        out = torch.empty(sum(chunks), dtype=torch.float32, device=send.device)
        work = _reduce_scatter(out, send.reshape(-1), group=group, async_op=True)

        def done() -> None:
            offset = 0
            for i, c in zip(indices, chunks, strict=True):
                start, stop = self.ranges[i]
                numel = self.params[i].numel()
                self.masters[i].grad = DTensor.from_local(out[offset:offset + stop - start], self.mesh, [Shard(0)],
                                                          run_check=False, shape=(numel,), stride=(1,))
                offset += c
        return [(work, done)]

    def grad_square_sum(self) -> torch.Tensor:
        """Sum of squares of this rank's gradient shards (each element lives on one rank)."""
        total = torch.zeros((), dtype=torch.float32, device=self.params[0].device if self.params else "cpu")
        for m in self.masters:
            if m.grad is not None:
                total += self.local(m.grad).square().sum()
        return total

    def scale_gradients(self, coef: float) -> None:
        for m in self.masters:
            if m.grad is not None:
                self.local(m.grad).mul_(coef)

    @torch.no_grad()
    def step(self, clip: dict[int, torch.Tensor] | None = None) -> None:
        """AdamW on the shards, then the updated weights all-gathered into every replica. With fp32 masters,
        QK-Clip's factors (`clip`: id(param) -> factor) are multiplied into the master shards first."""
        if self.adamw is None:
            return
        if not self.master:
            for p, m, (start, stop) in zip(self.params, self.masters, self.ranges, strict=True):
                # QK-Clip (or a load) edits the replicated weights between steps: the master follows them.
                self.local(m).copy_(p.detach().reshape(-1)[start:stop])
        self.adamw.step()
        for p, m, (start, stop) in zip(self.params, self.masters, self.ranges, strict=True):
            if clip and id(p) in clip:
                self.local(m).mul_(clip[id(p)].reshape(-1)[start:stop])
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None
            full = m.detach().to(p.dtype)
            if isinstance(full, DTensor):
                with comm_clock.timed():  # an all-gather
                    full = full.redistribute(self.mesh, [Replicate()]).to_local()
            p.view(-1).copy_(full)

    def state_bytes(self) -> int:
        """Bytes of the master shards and AdamW moments this rank holds."""
        total = 0
        for m in self.masters:
            for t in (m, self.adamw.state[m]["exp_avg"], self.adamw.state[m]["exp_avg_sq"]):
                local = self.local(t)
                total += local.numel() * local.element_size()
        return total
