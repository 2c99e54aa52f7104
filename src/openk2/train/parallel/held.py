"""Bytes a training rank's state tensors really hold: parameters, gradients, fp32 masters, optimizer state.

Counted from storages, not from shapes: each storage once, at its full size, so a view that pins a larger
buffer counts the buffer, and a tensor shared by two roles (tied weights) counts once, under the first role.
DTensors count their local shard. This is what checks `openk2 plan`'s formulas (plan.py) against what a rank
allocated (tests/train/parallel/test_memory.py); it does not read the process's heap, so activations and
allocator slack are not in it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

ROLES = ("params", "grads", "master", "optimizer")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the storages behind `tensors` not yet in `seen` (data pointers; updated in place)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def held_state_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    """{params, grads, master, optimizer, total}: bytes held right now by the model's parameters, their `.grad`,
    and the optimizer's `state_tensors()` ({"master": [...], "optimizer": [...]})."""
    seen: set[int] = set()
    params = list(model.parameters())
    extra = optimizer.state_tensors()
    grads = [t for p in params for t in (p.grad, getattr(p, "main_grad", None))]  # bf16 weights: fp32 main_grad
    out = {"params": storage_bytes(params, seen), "grads": storage_bytes(grads, seen),
           "master": storage_bytes(extra.get("master", ()), seen),
           "optimizer": storage_bytes(extra.get("optimizer", ()), seen)}
    out["total"] = sum(out[r] for r in ROLES)
    return out


def measure_states(config, parallel, device: torch.device, init_seed: int = 0, rows: int = 1,
                   seq_len: int = 16) -> dict[str, int]:
    """Build this rank's share and the trainer's optimizer, run one real forward/backward on random tokens
    (every rank of the job must call it), and return `held_state_bytes` at that point, the states' peak:
    full gradients, weights, masters and optimizer state all alive. pp = 1 only (a plain forward)."""
    from openk2.train.parallel.build import build_model_part
    from openk2.train.parallel.mesh import init_parallel
    from openk2.train.parallel.zero import build_optimizer

    if parallel.pp != 1:
        raise ValueError("measure_states runs a plain forward: parallel.pp must be 1")
    mesh = init_parallel(parallel, device)
    if parallel.shard == "fsdp2":  # weights, gradients and optimizer state all DTensor shards
        from openk2.train.parallel.fsdp import build_fsdp_model
        from openk2.train.parallel.fsdp_muonclip import build_fsdp_optimizer

        model = build_fsdp_model(config, mesh, device, init_seed)
        optimizer = build_fsdp_optimizer(model, mesh, {"lr": 1e-3, "ns_dtype": torch.float32})
    else:
        model, expert_names = build_model_part(config, mesh, device, init_seed)
        optimizer = build_optimizer(model, expert_names, mesh, {"lr": 1e-3, "ns_dtype": torch.float32})  # casts
    gen = torch.Generator().manual_seed(mesh.rank)
    ids = torch.randint(0, config.vocab_size, (rows, seq_len), generator=gen).to(device)
    model(ids, labels=ids).loss.backward()
    return held_state_bytes(model, optimizer)
