"""The one-token decode step as one static graph for torch.compile: fixed batch buckets, explicit cache tensors.

`decode_step.decode_hidden` is exact but eager: ~490 aten ops per step, each paying dispatch. This module writes
the same step (embedding, every layer, final norm, lm_head) as a function of tensors only, with no data-dependent
shape anywhere, so inductor can capture it whole (fullgraph) and fuse its pointwise work:

- the cache is an explicit [L, rows, C+R] tensor that the graph only reads (row gathers, the new rows standing in
  where they will be written); the graph returns the new rows [L, B, C+R] and one eager index_copy_ stores them
  (a write inside the graph followed by reads is functionalised into a copy of the whole cache every step);
- the routed experts run per (token, slot) pair: each pair's expert weights are indexed in place and reduced
  against its row ([M, I, D] products summed over D), which inductor lowers to one gather-and-reduce kernel per
  projection; the idle-expert search of the eager path (nonzero, a data-dependent size) is not needed;
- the batch is padded to a bucket (1, 2, 4, 8, ...), so a bounded set of graphs is compiled; the cached length S
  and the cache's row count are dynamic (one graph per bucket for every context length and every engine's cache).

Compiled graphs persist in inductor's on-disk caches (FX graph and AOTAutograd caches under
$TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_$USER), so a later process recompiles much faster (dynamo
still traces the step again). Inductor's kernels sum in their own order, so logits differ from the module path by
float rounding (tests check greedy tokens against it). The step is opt-in (`Engine(decode_compile=True)`); see
docs/benchmarks.md for its numbers. Shape legend: B batch (padded), D hidden, S cached positions, M = B*K (token,
slot) pairs, K experts per token, I expert width, E experts, L layers, V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from openk2.infer import decode_step
from openk2.model.layers import MLP
from openk2.model.moe import MoE

__all__ = ["CompiledDecode", "bucket", "static_logits"]

# (backend, options, bucket) -> the compiled step, shared by every engine in the process: a second engine over the
# same model reuses the first one's graphs (dynamo guards on the model it was traced with, and recompiles for others).
_COMPILED: dict[tuple[str, str, int], Callable] = {}


def bucket(b: int) -> int:
    """The padded batch size of `b` rows: the next power of two."""
    if b < 1:
        raise ValueError(f"a decode batch holds at least one row, got {b}")
    return 1 << (b - 1).bit_length()


def _pair_linear(x_MI: torch.Tensor, w_EOI: torch.Tensor, idx_M: torch.Tensor) -> torch.Tensor:
    # Row m times expert idx_M[m]'s W^T, as a reduction (inductor indexes the weight in place, no [M, O, I] copy),
    # summed in fp32 as a matmul accumulates (a bf16 sum drifts from the module path's tokens).
    return (x_MI[:, None, :].float() * w_EOI[idx_M].float()).sum(-1).to(x_MI.dtype)


def _static_moe(moe: MoE, x_BD: torch.Tensor) -> torch.Tensor:
    routing = moe.gate(x_BD)
    b, k = routing.indices_NK.shape
    idx_M = routing.indices_NK.reshape(-1)
    x_MD = x_BD[:, None].expand(b, k, x_BD.shape[-1]).reshape(b * k, -1)
    ex = moe.experts
    h_MI = F.silu(_pair_linear(x_MD, ex.gate_proj, idx_M)) * _pair_linear(x_MD, ex.up_proj, idx_M)
    y_MD = _pair_linear(h_MI, ex.down_proj, idx_M) * routing.weights_NK.reshape(-1, 1).to(h_MI.dtype)
    return y_MD.view(b, k, -1).sum(1).to(x_BD.dtype) + decode_step.mlp(moe.shared_experts, x_BD)


def static_logits(model: nn.Module, ids_B: torch.Tensor, positions_B: torch.Tensor, kv_LRX: torch.Tensor,
                  write_rows_B: torch.Tensor, read_rows_BS: torch.Tensor,
                  mask_B1S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits [B, V] of one new token per row attending over `read_rows` (mask True = may attend), and each
    layer's new cache rows [L, B, C+R] for the caller to store at `write_rows` (kv is not written here)."""
    inner = model.model
    x_BD = F.embedding(ids_B, inner.embed_tokens.weight)
    cos, sin = decode_step.rope_tables(model, positions_B, x_BD.dtype)
    new_rows: list[torch.Tensor] = []
    for layer in inner.layers:
        x_BD = x_BD + decode_step.attention(layer.self_attn, decode_step.rms(x_BD, layer.input_layernorm), cos, sin,
                                            kv_LRX, write_rows_B, read_rows_BS, mask_B1S, deferred=new_rows)
        h_BD = decode_step.rms(x_BD, layer.post_attention_layernorm)
        x_BD = x_BD + (_static_moe(layer.mlp, h_BD) if isinstance(layer.mlp, MoE) else decode_step.mlp(layer.mlp, h_BD))
    return model.lm_head(decode_step.rms(x_BD, inner.norm)).float(), torch.stack(new_rows)


class CompiledDecode:
    """One `torch.compile(fullgraph=True)` of `static_logits` per batch bucket; with inductor (the default
    backend) its C++ wrapper is on, which calls the kernels without a Python launcher (about 8% of a tiny step);
    backend "none" runs the same static graph uncompiled (for tests of its arithmetic and padding)."""

    def __init__(self, model: nn.Module, backend: str = "inductor", cpp_wrapper: bool = True) -> None:
        if not all(type(layer.mlp) in (MoE, MLP) for layer in model.model.layers):
            raise ValueError("decode_compile needs the plain K2 layout (MoE or MLP feed-forward in every layer)")
        dtype = model.model.embed_tokens.weight.dtype
        if dtype != torch.float32:
            # bf16: the experts' sums round differently from grouped_mm's, and greedy tokens then drift from the
            # module path's (1 of 4 rows over 12 tokens on the tiny preset), so only fp32 is offered.
            raise ValueError(f"decode_compile supports float32 models only, got {dtype}")
        self.model = model
        self.backend = backend
        self.options = {"cpp_wrapper": cpp_wrapper} if backend == "inductor" else None
        self.compile_s: dict[int, float] = {}  # bucket -> wall seconds of this engine's first call at that bucket

    def _fn(self, b: int) -> Callable:
        if self.backend == "none":
            return static_logits
        key = (self.backend, repr(self.options), b)
        fn = _COMPILED.get(key)
        if fn is None:
            fn = _COMPILED[key] = torch.compile(static_logits, fullgraph=True, dynamic=False, backend=self.backend,
                                                options=self.options)
        return fn

    def __call__(self, ids_B: torch.Tensor, positions_B: torch.Tensor, kv_LRX: torch.Tensor,
                 write_rows_B: torch.Tensor, read_rows_BS: torch.Tensor, mask_B1S: torch.Tensor | None,
                 scratch_row: int) -> torch.Tensor:
        """Logits [B, V] for B rows, padded to the bucket; padding rows write `scratch_row` and attend to it."""
        b, s = read_rows_BS.shape
        p = bucket(b) - b
        if mask_B1S is None:
            mask_B1S = torch.ones(b, 1, s, dtype=torch.bool, device=ids_B.device)
        if p:
            ids_B = F.pad(ids_B, (0, p))
            positions_B = F.pad(positions_B, (0, p))
            write_rows_B = F.pad(write_rows_B, (0, p), value=scratch_row)
            read_rows_BS = F.pad(read_rows_BS, (0, 0, 0, p), value=scratch_row)
            mask_B1S = F.pad(mask_B1S, (0, 0, 0, 0, 0, p), value=True)
        if self.backend != "none":  # one graph per bucket for every cached length S and cache size
            torch._dynamo.mark_dynamic(kv_LRX, 1)
            torch._dynamo.mark_dynamic(read_rows_BS, 1)
            torch._dynamo.mark_dynamic(mask_B1S, 2)
        fn = self._fn(b + p)
        first = b + p not in self.compile_s
        start = time.perf_counter()
        logits_BV, new_LBX = fn(self.model, ids_B, positions_B, kv_LRX, write_rows_B, read_rows_BS, mask_B1S)
        if first:
            self.compile_s[b + p] = time.perf_counter() - start
        num_layers, rows = kv_LRX.shape[:2]  # layer l's row r is row l * rows + r of the flat cache
        flat_rows = (torch.arange(num_layers, device=kv_LRX.device)[:, None] * rows + write_rows_B).view(-1)
        kv_LRX.view(-1, kv_LRX.shape[-1]).index_copy_(0, flat_rows, new_LBX.view(-1, new_LBX.shape[-1]))
        return logits_BV[:b]
