"""Moving whole-model state in and out of a sharded model: gather to rank 0 for saving, slice on loading.

Checkpoints keep the single-device HF layout (so any layout, or transformers, can read them); only the optimizer
is saved per rank. Gathering goes through rank 0's CPU memory, which is fine up to a few billion parameters;
at K2's scale one would write each rank's tensors with torch.distributed.checkpoint instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM
from openk2.model.io import hf_state_dict, load_into
from openk2.train.parallel.expert import EXPERT_WEIGHTS, gather_expert_weight
from openk2.train.parallel.mesh import ParallelMesh
from openk2.train.parallel.pipeline import PipelineModel


def _is_expert_weight(name: str) -> bool:
    return name.rsplit(".", 2)[-2:-1] == ["experts"] and name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS


def local_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's live parameters and persistent buffers under the full model's names."""
    if isinstance(model, PipelineModel):
        return {model.full_names[n]: t for n, t in model.state_dict(keep_vars=True).items()}
    return dict(model.state_dict(keep_vars=True))


@torch.no_grad()
def gather_full_state(model: nn.Module, mesh: ParallelMesh) -> dict[str, torch.Tensor] | None:
    """The full model's state dict (CPU) on rank 0, None elsewhere; every rank must call it."""
    part = {}
    for name, tensor in sorted(local_tensors(model).items()):  # same order on every ep rank
        if mesh.config.ep > 1 and _is_expert_weight(name):
            tensor = gather_expert_weight(tensor, mesh)
        part[name] = tensor.detach().cpu().clone()
    if mesh.config.pp == 1:
        return part if mesh.is_main else None
    if mesh.dp_rank or mesh.ep_rank:  # replicas of rank 0's pipeline hold the same tensors
        return None
    parts = [None] * mesh.config.pp if mesh.is_main else None
    dist.gather_object(part, parts, dst=0, group=mesh.group("pp"))
    return {k: v for p in parts for k, v in p.items()} if mesh.is_main else None


@torch.no_grad()
def load_full_state(model: nn.Module, state: dict[str, torch.Tensor], mesh: ParallelMesh) -> None:
    """Copy a full model's state dict into this rank's part of the model (expert slices cut out)."""
    for name, tensor in local_tensors(model).items():
        if name not in state:
            raise ValueError(f"checkpoint has no tensor {name}")
        source = state[name]
        if mesh.config.ep > 1 and _is_expert_weight(name):
            n = tensor.shape[0]
            source = source[mesh.ep_rank * n:(mesh.ep_rank + 1) * n]
        if source.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(source.shape)}, the model expects "
                             f"{tuple(tensor.shape)}")
        tensor.copy_(source)


@torch.no_grad()
def load_hf_part(model: nn.Module, config: ModelConfig, path, mesh: ParallelMesh) -> int:
    """Fill this rank's share from an HF safetensors checkpoint, reading only the tensors it owns (its stages,
    its experts); returns the bytes read."""
    targets = local_tensors(model)
    offsets = {name: mesh.ep_rank * t.shape[0] for name, t in targets.items()
               if mesh.config.ep > 1 and _is_expert_weight(name)}
    with torch.device("meta"):
        everything = frozenset(key for key, _ in hf_state_dict(K2ForCausalLM(config)))
    return load_into(targets, config, path, offsets, everything)


def save_full_model(state: dict[str, torch.Tensor], config: ModelConfig, path) -> None:
    """Write a gathered state dict as an HF-layout checkpoint (the same files a single-device run writes)."""
    with torch.device("meta"):
        model = K2ForCausalLM(config)
    model.load_state_dict(state, assign=True)
    model.save_pretrained(path)
