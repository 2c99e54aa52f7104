"""This rank's share of the model, built without the rest: meta construction, expert shard, pipeline cut, then
allocation and layout-independent initialisation of only what the rank owns.

1. `K2ForCausalLM(config)` under `torch.device("meta")`: shapes only, no bytes (the 1T kimi-k2 preset included);
2. `shard_experts` keeps this ep rank's routed experts, `PipelineModel` this pp rank's stages;
3. `to_empty` allocates the kept tensors on the device and `init_weights` fills them from per-tensor generators
   seeded by (init_seed, full-model name, global expert index), so the gathered parts equal the single-process
   model bit for bit whatever the layout (model/init.py).

`openk2 plan` stops after step 2 (nothing allocated) to count each rank's bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM
from openk2.model.init import init_weights
from openk2.train.parallel.expert import shard_experts
from openk2.train.parallel.mesh import ParallelMesh
from openk2.train.parallel.pipeline import PipelineModel


def meta_model_part(config: ModelConfig, mesh: ParallelMesh) -> tuple[nn.Module, frozenset[str]]:
    """This rank's share of the model on the meta device (a K2ForCausalLM, or a PipelineModel when pp > 1) and
    the full names of its expert-sharded parameters."""
    with torch.device("meta"):
        full = K2ForCausalLM(config)
    expert_names = shard_experts(full, mesh)
    part = PipelineModel(full, mesh) if mesh.config.pp > 1 else full
    return part, expert_names


def full_name_of(part: nn.Module):
    """Local tensor name -> full-model name (identity unless `part` is a PipelineModel)."""
    names = part.full_names if isinstance(part, PipelineModel) else {}
    return lambda name: names.get(name, name)


@torch.no_grad()
def materialize(part: nn.Module, config: ModelConfig, device: torch.device, init_seed: int) -> nn.Module:
    """Allocate a meta-built share on `device` (fp32) and initialise it as the same tensors of the
    single-process `K2ForCausalLM(config, init_seed=init_seed)`."""
    part.to_empty(device=device)
    if isinstance(part, K2ForCausalLM):
        part.init_seed = init_seed
        if config.tie_word_embeddings:  # to_empty replaces each module's entry by a new tensor: re-tie
            part.lm_head.weight = part.model.embed_tokens.weight
    init_weights(part, config, init_seed, full_name_of(part))
    return part


def build_model_part(config: ModelConfig, mesh: ParallelMesh, device: torch.device,
                     init_seed: int) -> tuple[nn.Module, frozenset[str]]:
    """This rank's share, allocated on `device` and initialised; never allocates what other ranks own."""
    part, expert_names = meta_model_part(config, mesh)
    return materialize(part, config, device, init_seed), expert_names
