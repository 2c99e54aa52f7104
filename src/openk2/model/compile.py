"""Regional compilation: `torch.compile` applied to each decoder block in place, as torchtitan does.

Compiling the blocks one by one instead of the whole model keeps compile time to one block's graph (the
blocks share code, so later ones mostly reuse the first one's kernels), leaves the embedding, lm_head and
loss eager, and keeps parameter names unchanged (`nn.Module.compile` compiles in place, no `_orig_mod.`
prefix), so checkpoints, optimizers and parallel plans see the same model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch._dynamo
from torch import nn

from openk2.model.transformer import DecoderLayer

__all__ = ["allow_a_graph_per_block", "compile_blocks", "compile_seconds"]


def compile_blocks(
    model: nn.Module,
    *,
    dynamic: bool | None = True,
    backend: str | Callable = "inductor",
    mode: str | None = None,
) -> int:
    """Compile every DecoderLayer of `model` in place; returns how many were compiled.

    dynamic=True traces sizes (batch, sequence length) symbolically, so packed and variable-length batches
    reuse one graph instead of recompiling per length; None lets torch decide after the first recompile.
    Compilation itself happens lazily, on each block's first call (see `compile_seconds`).
    """
    blocks = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no DecoderLayer to compile")
    allow_a_graph_per_block(len(blocks))
    for block in blocks:
        block.compile(dynamic=dynamic, backend=backend, mode=mode)
    return len(blocks)


def allow_a_graph_per_block(blocks: int) -> None:
    """Raise dynamo's per-code-object recompile limit so that every block gets its graph.

    The blocks share one `forward` code object, and dynamo guards on Python state that differs per block (the
    layer index, the stats collector's per-layer entries), so each block compiles its own graph under the same
    code object. At the default limit (8) every block past the eighth silently ran eagerly, with one warning
    (tests/model/test_compile.py). Twice the block count leaves each block one recompile of its own (a second
    grad mode or a 0/1-specialised size)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 2 * blocks)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * blocks)


def compile_seconds() -> float | None:
    """Wall seconds this process has spent compiling so far (forward and backward graphs), or None if torch
    does not report it; the difference across a first step is that step's compile warm-up."""
    try:
        from torch._dynamo.utils import calculate_time_spent  # a private helper: absent in some versions

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except (ImportError, AttributeError, TypeError):
        return None

