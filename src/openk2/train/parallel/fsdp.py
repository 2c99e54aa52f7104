"""FSDP2 (`parallel.shard = "fsdp2"`, ZeRO-3): weights, gradients and optimizer state all sharded over dp.

Built from torch's own `fully_shard` (torch.distributed.fsdp): each decoder layer is one FSDP2 unit, then the
root (embedding, final norm, lm_head). Parameters become DTensors `Shard(0)` over the "dp" axis of the mesh
(torch.chunk's rule: rank r holds rows [r c, (r + 1) c), c = ceil(rows / dp)); FSDP2 all-gathers a unit's
weights for its forward and backward and reduce-scatters its gradients. The trainer sums gradients over ranks
(its losses are already shares of the global token mean), so FSDP2's averaging is switched off: divide factor
1 with SUM-only collectives (gloo has no PREMUL_SUM, which FSDP2 would otherwise use for a custom factor).

Construction never holds the whole model: the model is built on the meta device, then one layer at a time is
allocated, initialised as the single-process model (model/init.py: per-tensor generators keyed by full name)
and sharded, so a rank's peak is its shards plus one whole layer; the root's own tensors come last.
With `parallel.param_dtype = "bfloat16"` the sharded fp32 parameters are the masters: FSDP2's mixed-precision
policy all-gathers them as bf16 for compute and reduce-scatters the gradients in fp32 into fp32 shards, so the
optimizer (and QK-Clip) works on fp32 as with fp32 weights.

With ep > 1 (the report's layout: expert parallelism inside a data-parallel replica) the routed experts are
first cut to this ep rank's slice (expert.py), and that slice is its own FSDP2 unit over the "dp" axis only
(the ranks holding the same experts), applied before its decoder layer's unit, which then takes the rest of the
layer; the dense weights (every other unit) are sharded over "data" = dp x ep, every rank that reads its own
tokens. So a rank keeps 1/(dp ep) of every dense tensor and 1/dp of its ep rank's experts.

With pp > 1 only this rank's pipeline stages are built (pipeline.py's PipelineModel over the meta model); each
stage module is then a root unit, which torch's PipelineStage drives: it keeps the stage gathered with unsharded
gradients accumulating over the micro-batches and reduce-scatters them after the stage's last backward.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM
from openk2.model.init import init_weights
from openk2.model.moe import MoE
from openk2.train.parallel.expert import shard_experts
from openk2.train.parallel.mesh import ParallelMesh
from openk2.train.parallel.pipeline import PipelineModel


def shard_rows(rows: int, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the dim-0 rows `rank` of `size` holds under FSDP2's Shard(0) (torch.chunk's rule)."""
    chunk = -(-rows // size)
    return min(rows, rank * chunk), min(rows, (rank + 1) * chunk)


@torch.no_grad()
def _materialize_own(module: nn.Module, device: torch.device, memo: dict[int, nn.Parameter]) -> None:
    """Allocate the meta parameters and buffers `module` holds itself (not its children's); tied ones once."""
    for name, p in list(module._parameters.items()):
        if p is not None and p.is_meta:
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            module._parameters[name] = memo[id(p)]
    for name, b in list(module._buffers.items()):
        if b is not None and b.is_meta:
            module._buffers[name] = torch.empty_like(b, device=device)


def _sum_gradients(module: FSDPModule) -> None:
    # The trainer's per-rank losses are shares of the global mean: gradients add up over ranks, never average.
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def dense_mesh(mesh: ParallelMesh):
    """The 1-D DeviceMesh dense weights are sharded over: "dp", or "data" (dp x ep flattened) when ep > 1."""
    # mesh.py flattened "data" once; _flatten returns that same mesh (slicing it by name is deprecated)
    return mesh.mesh["dp", "ep"]._flatten("data") if mesh.config.ep > 1 else mesh.mesh["dp"]


def build_fsdp_model(config: ModelConfig, mesh: ParallelMesh, device: torch.device,
                     init_seed: int) -> K2ForCausalLM | PipelineModel:
    """The model (its pipeline stages when pp > 1) with every decoder layer and the root (each stage) wrapped by
    `fully_shard` (dense weights over "dp", or "data" when ep > 1; this ep rank's experts over "dp"), initialised
    as `K2ForCausalLM(config, init_seed=init_seed)`; no rank ever holds more than one whole layer (of its own
    experts)."""
    if mesh.mesh is None:
        raise ValueError("parallel.shard = fsdp2 needs a distributed run (parallel.dp x ep > 1)")
    dense, expert_mesh = dense_mesh(mesh), mesh.mesh["dp"]
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mesh.config.param_dtype == "bfloat16" else MixedPrecisionPolicy())
    with torch.device("meta"):
        model = K2ForCausalLM(config)
    if mesh.config.ep > 1 and mesh.config.ep_overlap:
        # FSDP2 gathers a unit's weights in hooks around its module call; the overlapped dispatch runs the
        # experts' matmuls later, outside that call, so here the experts run as one call (no overlap).
        if mesh.is_main:
            warnings.warn("parallel.ep_overlap is not applied under parallel.shard=fsdp2: the EP dispatch is waited "
                          "at once (set parallel.ep_overlap=false to silence this)", stacklevel=2)
        mesh = dataclasses.replace(mesh, config=dataclasses.replace(mesh.config, ep_overlap=False))
    shard_experts(model, mesh)  # meta slices of this ep rank's experts (nothing when ep = 1)
    part = PipelineModel(model, mesh) if mesh.config.pp > 1 else model  # this rank's stages; the rest stays meta
    memo: dict[int, nn.Parameter] = {}
    for i in part.layer_ids if isinstance(part, PipelineModel) else range(config.num_hidden_layers):
        layer = model.model.layers[i]
        for sub in layer.modules():
            _materialize_own(sub, device, memo)
        init_weights(layer, config, init_seed, lambda name, i=i: f"model.layers.{i}.{name}")
        if mesh.config.ep > 1 and isinstance(layer.mlp, MoE):  # the experts' unit first, so the layer's skips them
            fully_shard(layer.mlp.experts, mesh=expert_mesh, mp_policy=policy)
            _sum_gradients(layer.mlp.experts)
        fully_shard(layer, mesh=dense, mp_policy=policy)
        _sum_gradients(layer)
    root = [(n, m) for n, m in model.named_children() if n != "model"]
    root += [(f"model.{n}", m) for n, m in model.model.named_children() if n != "layers"]
    held = {id(m) for m in part.modules()}
    for name, sub in root:  # embed_tokens, norm, rotary_emb, lm_head (those of this rank's stages)
        if id(sub) not in held:
            continue
        for piece in sub.modules():
            _materialize_own(piece, device, memo)
        if not (name == "lm_head" and config.tie_word_embeddings):  # a tied head was initialised as the embedding
            init_weights(sub, config, init_seed, lambda local, name=name: f"{name}.{local}")
    assert not any(t.is_meta for t in (*part.parameters(), *part.buffers())), "a tensor was left on meta"
    if isinstance(part, PipelineModel):
        # Each stage is a root unit, what torch's PipelineStage drives: it accumulates unsharded gradients over
        # the micro-batches and reduce-scatters them once, after the stage's last backward.
        for stage in part.stages:
            fully_shard(stage, mesh=dense, mp_policy=policy)
            _sum_gradients(stage)
        return part
    model.init_seed = init_seed
    fully_shard(model, mesh=dense, mp_policy=policy)
    _sum_gradients(model)
    return model
