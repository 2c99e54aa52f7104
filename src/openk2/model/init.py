"""Layout-independent weight initialisation: every tensor draws from its own generator, seeded by
(run seed, the tensor's full-model name, the routed expert's global index).

A model cut into pipeline stages and expert shards therefore initialises each piece it owns to exactly the
values the single-process model holds there, without ever materialising the rest: the parallel trainer builds
the model on the `meta` device, keeps its share, allocates it and calls `init_weights` with the full names.
Values are drawn on the CPU in fp32 whatever the target device, so they do not depend on the device's RNG.

Rules (as DeepSeek-V3 / HF initialise): Normal(0, initializer_range) for linear, embedding, router and expert
matrices; ones for RMSNorm weights; zeros for biases and the router's correction bias; rope frequencies
recomputed. A sharded RoutedExperts (train/parallel/expert.py) says which experts it holds through an
`expert_offset` attribute (the global index of its first expert; 0 when absent).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

from openk2.config import ModelConfig
from openk2.model.layers import RMSNorm
from openk2.model.moe import RoutedExperts, Router
from openk2.model.rope import RotaryEmbedding, rope_inv_freq

_SEED_MASK = (1 << 63) - 1


def draw_init_seed() -> int:
    """One draw from torch's global CPU generator: the base seed of a model built after `torch.manual_seed`."""
    return int(torch.randint(0, 1 << 62, (), dtype=torch.int64))


def tensor_seed(seed: int, name: str, index: int | None = None) -> int:
    """The generator seed of one tensor (or one routed expert's slice of it): a hash of (seed, name, index)."""
    key = f"{seed}/{name}" if index is None else f"{seed}/{name}/{index}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & _SEED_MASK


@torch.no_grad()
def _normal(dest: torch.Tensor, std: float, seed: int) -> None:
    # Drawn on the CPU whatever the default device, so the weights are the same on every device and layout.
    g = torch.Generator(device="cpu").manual_seed(seed)
    dest.copy_(torch.empty(dest.shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=g))


@torch.no_grad()
def init_weights(module: nn.Module, config: ModelConfig, seed: int,
                 full_name: Callable[[str], str] | None = None) -> None:
    """Initialise every parameter and buffer of `module` (a K2ForCausalLM or any part of one); `full_name` maps
    a local tensor name to its name in the whole K2ForCausalLM (identity by default). Meta tensors are skipped."""
    rename = full_name or (lambda name: name)
    std = config.initializer_range
    seen: set[int] = set()
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for local, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
            if id(t) in seen or t.is_meta:
                continue
            seen.add(id(t))
            name = rename(f"{prefix}.{local}" if prefix else local)
            _init_tensor(mod, local, t, name, std, seed, config)


def _init_tensor(mod: nn.Module, local: str, t: torch.Tensor, name: str, std: float, seed: int,
                 config: ModelConfig) -> None:
    if isinstance(mod, RoutedExperts):
        offset = getattr(mod, "expert_offset", 0)
        for e in range(t.shape[0]):
            _normal(t[e], std, tensor_seed(seed, name, offset + e))
    elif isinstance(mod, RotaryEmbedding):
        t.copy_(rope_inv_freq(config)[0])
    elif isinstance(mod, RMSNorm):
        t.fill_(1.0)
    elif local.endswith("bias"):  # linear biases and the router's e_score_correction_bias
        t.zero_()
    elif local == "weight" and isinstance(mod, (nn.Linear, nn.Embedding, Router)):
        _normal(t, std, tensor_seed(seed, name))
    else:
        raise ValueError(f"no initialisation rule for {name} ({type(mod).__name__}.{local})")
