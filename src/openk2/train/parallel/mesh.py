"""Process groups for pp x dp x ep, built once from `[parallel]` with `init_device_mesh`.

Rank layout (row-major over ("pp", "dp", "ep")): rank = (pp_rank * dp + dp_rank) * ep + ep_rank, so the ep
ranks of one expert group are neighbours (one node's NVLink domain on GPUs) and pipeline peers are far apart.
Three groups matter: "ep" (token dispatch, expert weights split), "data" = dp x ep flattened (every rank reading
its own tokens: dense gradients reduce over it) and "dp" (expert gradients reduce over it); "pp" links stages.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from openk2.train.parallel.config import ParallelConfig

MESH_AXES = ("pp", "dp", "ep")


@dataclass
class ParallelMesh:
    """This rank's coordinates and process groups; `ParallelMesh.single()` when nothing is distributed."""

    config: ParallelConfig
    mesh: DeviceMesh | None
    rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)

    @classmethod
    def single(cls, config: ParallelConfig | None = None) -> ParallelMesh:
        """One process, nothing distributed (`config`: a one-rank layout's other settings, e.g. param_dtype)."""
        return cls(config or ParallelConfig(), None, 0, 0, 0, 0)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, plots and writes the model."""
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Index of this rank's slice of the global batch (dp x ep ranks read different tokens)."""
        return self.dp_rank * self.config.ep + self.ep_rank

    @property
    def num_data_ranks(self) -> int:
        return self.config.dp * self.config.ep

    @property
    def is_last_stage_rank(self) -> bool:
        """Whether this rank computes the loss (the last pipeline stage lives on the last pp rank)."""
        return self.pp_rank == self.config.pp - 1

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of one axis ("pp", "dp", "ep") or "data" (dp x ep); None when not distributed."""
        if self.mesh is None:
            return None
        return self.groups[axis]


def backend_for(config: ParallelConfig, device: torch.device) -> str:
    if config.backend != "auto":
        return config.backend
    return "nccl" if device.type == "cuda" else "gloo"


def init_parallel(config: ParallelConfig, device: torch.device, timeout_s: float = 600.0) -> ParallelMesh:
    """Join the torchrun job (env:// rendezvous) and build the pp x dp x ep mesh; checks the world size."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != config.world_size:
        raise ValueError(f"parallel.pp x dp x ep = {config.pp} x {config.dp} x {config.ep} = {config.world_size} "
                         f"ranks, but {world} were launched (torchrun --nproc-per-node N, times the node count)")
    if not config.enabled:
        return ParallelMesh.single(config)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(config, device), timeout=datetime.timedelta(seconds=timeout_s))
    shape = (config.pp, config.dp, config.ep)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_AXES)
    rank = dist.get_rank()
    pp_rank, dp_rank, ep_rank = (mesh.get_local_rank(axis) for axis in MESH_AXES)
    groups = {axis: mesh.get_group(axis) for axis in MESH_AXES}
    groups["data"] = mesh["dp", "ep"]._flatten("data").get_group()
    return ParallelMesh(config, mesh, rank, pp_rank, dp_rank, ep_rank, groups)
