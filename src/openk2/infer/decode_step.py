"""The engine's one-token decode step with fewer eager ops: the model's own weights and arithmetic, laid out for T=1.

At short context a decode step is mostly per-op dispatch on tensors of a few KB (docs/benchmarks.md, "Where a
short-context decode step goes"): about 75 eager ops per attention layer and 6 per RMSNorm. This module runs the
same computation as `K2Model.forward` with `LatentCacheAttention(absorbed=True)` over one new token per row, with
the ops regrouped where that changes no bit of the result (each is checked against the module path by
tests/infer/test_decode_step.py):

- tensors stay [B, ...] (no T axis), weights are read as plain tensors (no nn.Module call per linear);
- fp32 RMSNorm is one fused `F.rms_norm` (the same reduction as the module's pow/mean/rsqrt, bit for bit);
- rope is x * [cos, cos] + swap_halves(x) * [-sin, sin], built once per step for every layer (a - b == a + (-b));
- the absorbed attention's per-head projections are batched matmuls over heads (what its einsums lower to).

The routed and shared experts and the router are the model's own modules (their ops do not depend on T).
`supports(model)` says whether a model is the plain K2 layout this step knows; anything else (wrapped layer
forwards, hooks, other module types) keeps the module path, which stays the exact reference.

Shape legend: B batch (one new token each), D hidden, H heads, C kv_lora_rank, N qk_nope_head_dim,
R qk_rope_head_dim, V v_head_dim, S cached positions (after this token), Q q_lora_rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from openk2.infer.kv_cache import PagedLatentCache
from openk2.model.attention import MLAttention
from openk2.model.layers import MLP, RMSNorm
from openk2.model.moe import MoE
from openk2.model.routing import RoutingTrace
from openk2.model.transformer import DecoderLayer

__all__ = ["attention", "decode_hidden", "mlp", "rms", "rope_tables", "supports"]


def _plain(module: nn.Module) -> bool:
    # No instance-level forward (memory options and wrappers patch layer.forward) and no hooks anywhere below.
    return all("forward" not in m.__dict__ and not (m._forward_hooks or m._forward_pre_hooks)
               for m in module.modules())


def supports(model: nn.Module) -> bool:
    """Whether `model` (a K2ForCausalLM) has exactly the modules this decode step re-implements, unwrapped."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not isinstance(inner.norm, RMSNorm) or not _plain(inner):
        return False
    return all(type(layer) is DecoderLayer and type(layer.self_attn) is MLAttention
               and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
               and type(layer.mlp) in (MoE, MLP) for layer in layers)


def rms(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """The RMSNorm module's result on x [..., D] (one fused F.rms_norm in fp32)."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)
    return norm(x)  # other dtypes: the module's own casts (fp32 statistics, weight applied in x's dtype)


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def rope_tables(model: nn.Module, positions_B: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[cos, cos] and [-sin, sin] [B, 1, R] for one token per row: the rotary embedding's own tables."""
    cos, sin = model.model.rotary_emb(positions_B[:, None])  # [B, 1, R/2], as the module path computes them
    cos, sin = cos.to(dtype), sin.to(dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def _rope(x_BXR: torch.Tensor, cos_B1R: torch.Tensor, sin_B1R: torch.Tensor, interleaved: bool) -> torch.Tensor:
    # apply_rope computes [x1 cos - x2 sin, x2 cos + x1 sin]; swapping halves gives the same sums term by term.
    if interleaved:
        x_BXR = torch.cat((x_BXR[..., 0::2], x_BXR[..., 1::2]), dim=-1)
    half = x_BXR.shape[-1] // 2
    return x_BXR * cos_B1R + x_BXR.roll(half, dims=-1) * sin_B1R


def attention(attn: MLAttention, x_BD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_LRX: torch.Tensor,
              write_rows_B: torch.Tensor, read_rows_BS: torch.Tensor, mask_B1S: torch.Tensor | None,
              deferred: list[torch.Tensor] | None = None) -> torch.Tensor:
    """MLAttention's absorbed one-token output [B, D] (after o_proj), storing the new latents in the cache tensor
    kv [L, rows, C+R] (PagedLatentCache.kv) at `write_rows` and attending over `read_rows`. With a `deferred` list
    the cache is only read: the new rows [B, C+R] are appended to it for the caller to write, and stand in for the
    read rows equal to `write_rows` (the same values the write would give; under torch.compile a write into the
    cache input followed by reads of it is functionalised into a copy of the whole cache every step)."""
    b = x_BD.shape[0]
    h, n, c, v = attn.num_heads, attn.nope_dim, attn.kv_lora_rank, attn.v_dim
    if hasattr(attn, "q_proj"):
        q = _linear(x_BD, attn.q_proj)
    else:
        q = _linear(rms(_linear(x_BD, attn.q_a_proj), attn.q_a_layernorm), attn.q_b_proj)
    q_BHK = q.view(b, h, -1)
    c_BC, k_rope_BR = _linear(x_BD, attn.kv_a_proj_with_mqa).split([c, attn.rope_dim], dim=-1)
    c_BC = rms(c_BC, attn.kv_a_layernorm)
    roped = _rope(torch.cat((q_BHK[..., n:], k_rope_BR[:, None]), dim=1), cos, sin, attn.rope_interleave)
    kv_RX = kv_LRX[attn.layer_idx]  # PagedLatentCache.write and .read, on the tensor
    new_BX = torch.cat((c_BC, roped[:, -1]), dim=-1).to(kv_RX.dtype)
    if deferred is None:
        kv_RX.index_copy_(0, write_rows_B, new_BX)
        kv_BSX = kv_RX[read_rows_BS]
    else:
        deferred.append(new_BX)
        fresh_BS1 = (read_rows_BS == write_rows_B[:, None])[..., None]
        kv_BSX = torch.where(fresh_BS1, new_BX[:, None], kv_RX[read_rows_BS])
    w_HXC = attn.kv_b_proj.weight.view(h, n + v, c)
    dtype = q_BHK.dtype
    q_lat_HBC = torch.bmm(q_BHK[..., :n].transpose(0, 1), w_HXC[:, :n].to(dtype))
    q_BHX = (torch.cat((q_lat_HBC.transpose(0, 1), roped[:, :-1]), dim=-1) * attn.scale).to(kv_BSX.dtype)
    scores_BHS = torch.bmm(q_BHX, kv_BSX.transpose(1, 2)).float()
    if mask_B1S is not None:
        scores_BHS = scores_BHS.masked_fill(~mask_B1S, float("-inf"))
    probs_BHS = scores_BHS.softmax(dim=-1).to(kv_BSX.dtype)
    out_lat_HBC = torch.bmm(probs_BHS, kv_BSX[..., :c]).to(dtype).transpose(0, 1)
    out_HBV = torch.bmm(out_lat_HBC, w_HXC[:, n:].to(dtype).transpose(1, 2))
    return _linear(out_HBV.transpose(0, 1).reshape(b, h * v), attn.o_proj)


def mlp(mlp: MLP, x_BD: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP module's result on x [B, D]."""
    return _linear(F.silu(_linear(x_BD, mlp.gate_proj)) * _linear(x_BD, mlp.up_proj), mlp.down_proj)


def _moe(moe: MoE, x_BD: torch.Tensor, trace: RoutingTrace | None) -> torch.Tensor:
    # MoE.forward for [B, 1, D] input, in eval mode (no aux loss) and without a stats collector.
    routed, _ = moe.experts(x_BD, moe.route(x_BD, trace))
    return routed.to(x_BD.dtype) + mlp(moe.shared_experts, x_BD)


def decode_hidden(model: nn.Module, ids_B: torch.Tensor, positions_B: torch.Tensor, cache: PagedLatentCache,
                  write_rows_B: torch.Tensor, read_rows_BS: torch.Tensor, mask_B1S: torch.Tensor | None = None,
                  trace: RoutingTrace | None = None) -> torch.Tensor:
    """Final-norm hidden states [B, D] of one new token per row (ids at `positions`), caching each layer's latent
    at `write_rows` and attending over `read_rows` (mask True = may attend; None = every row sees all S)."""
    inner = model.model
    x_BD = F.embedding(ids_B, inner.embed_tokens.weight)
    cos, sin = rope_tables(model, positions_B, x_BD.dtype)
    for layer in inner.layers:
        x_BD = x_BD + attention(layer.self_attn, rms(x_BD, layer.input_layernorm), cos, sin, cache.kv,
                                write_rows_B, read_rows_BS, mask_B1S)
        h_BD = rms(x_BD, layer.post_attention_layernorm)
        x_BD = x_BD + (_moe(layer.mlp, h_BD, trace) if isinstance(layer.mlp, MoE) else mlp(layer.mlp, h_BD))
    return rms(x_BD, inner.norm)
