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
optimizer (and QK-Clip) works on fp32 as with fp32 weights. Only pp = 1 and ep = 1 (config.py refuses the rest).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM
from openk2.model.init import init_weights
from openk2.train.parallel.mesh import ParallelMesh


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


def build_fsdp_model(config: ModelConfig, mesh: ParallelMesh, device: torch.device,
                     init_seed: int) -> K2ForCausalLM:
    """The model with every decoder layer and the root wrapped by `fully_shard` over the mesh's "dp" axis,
    initialised as `K2ForCausalLM(config, init_seed=init_seed)`; no rank ever holds more than one whole layer."""
    if mesh.mesh is None:
        raise ValueError("parallel.shard = fsdp2 needs a distributed run (parallel.dp > 1)")
    dp_mesh = mesh.mesh["dp"]
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mesh.config.param_dtype == "bfloat16" else MixedPrecisionPolicy())
    with torch.device("meta"):
        model = K2ForCausalLM(config)
    memo: dict[int, nn.Parameter] = {}
    for i, layer in enumerate(model.model.layers):
        for sub in layer.modules():
            _materialize_own(sub, device, memo)
        init_weights(layer, config, init_seed, lambda name, i=i: f"model.layers.{i}.{name}")
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
        _sum_gradients(layer)
    root = [(n, m) for n, m in model.named_children() if n != "model"]
    root += [(f"model.{n}", m) for n, m in model.model.named_children() if n != "layers"]
    for name, sub in root:  # embed_tokens, norm, rotary_emb, lm_head
        for piece in sub.modules():
            _materialize_own(piece, device, memo)
        if not (name == "lm_head" and config.tie_word_embeddings):  # a tied head was initialised as the embedding
            init_weights(sub, config, init_seed, lambda local, name=name: f"{name}.{local}")
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers())), "a tensor was left on meta"
    model.init_seed = init_seed
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    _sum_gradients(model)
    return model
