"""The K2 causal LM: embedding, decoder blocks (first_k_dense dense MLP layers, then MoE), final norm, lm_head.

Parameter names follow HF's DeepseekV3ForCausalLM, except routed experts, which are stacked 3-D weights here
(`mlp.experts.gate_proj` [E, I, D]) and per-expert tensors in checkpoints (see io.py).
Shape legend: B batch, T sequence, D hidden, V vocab, L layers, H heads, E routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from openk2.config import ModelConfig
from openk2.model.attention import InnerAttention, MLAttention, segment_causal_mask
from openk2.model.chunked_loss import chunked_cross_entropy
from openk2.model.fused_loss import cross_entropy
from openk2.model.init import draw_init_seed, init_weights
from openk2.model.layers import MLP, RMSNorm
from openk2.model.moe import MoE
from openk2.model.rope import RotaryEmbedding
from openk2.model.routing import RoutingTrace
from openk2.model.stats import ForwardStats


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # [B, T, V]; None when the loss was computed in chunks (loss_chunk_tokens)
    loss: torch.Tensor | None = None  # mean next-token cross-entropy (+ aux_loss when present)
    aux_loss: torch.Tensor | None = None  # sum of the MoE layers' sequence-wise balance losses
    tokens_per_expert: torch.Tensor | None = None  # [num_moe_layers, E] routed (token, slot) counts this call


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)); the one body training, pipeline stages and the
    inference engine all run."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg, layer_idx) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        stats: ForwardStats | None = None,
        inner_attention: InnerAttention | None = None,
        routing: RoutingTrace | None = None,
    ) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; `stats` records what the layer saw, `inner_attention` swaps the attention
        core (see MLAttention.forward), `routing` records (and may replay) the MoE experts (model/routing.py)."""
        x_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), cos, sin, attn_mask, stats, inner_attention)
        h_BTD = self.post_attention_layernorm(x_BTD)
        return x_BTD + (self.mlp(h_BTD, stats, routing) if isinstance(self.mlp, MoE) else self.mlp(h_BTD))


class K2Model(nn.Module):
    """Embedding, decoder layers, final norm: token ids -> normalised hidden states."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        stats: ForwardStats | None = None,
        inner_attention: InnerAttention | None = None,
        routing: RoutingTrace | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> final-norm hidden [B, T, D] (positions default to 0..T-1); `routing` as in
        DecoderLayer."""
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        cos, sin = self.rotary_emb(position_ids)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            # Keywords: memory options wrap layer.forward and hand `stats` to the first (non-replayed) call only.
            x = layer(x, cos, sin, attn_mask, stats=stats, inner_attention=inner_attention, routing=routing)
        return self.norm(x)


class K2ForCausalLM(nn.Module):
    """Kimi K2 / DeepSeek-V3 (main model) causal LM."""

    def __init__(self, config: ModelConfig, init_seed: int | None = None) -> None:
        """Built on the current default device; on `meta` nothing is allocated or initialised. `init_seed` fixes
        the weights (see model/init.py); by default it is one draw from torch's global generator (the only one
        construction makes), so `torch.manual_seed(s)` before construction still decides them (a meta build
        draws nothing)."""
        super().__init__()
        self.config = config
        device = torch.empty(0).device  # the caller's default device
        # Modules are built on meta, so their own default inits neither run nor consume the global generator:
        # an eager build and a meta build followed by materialisation (train/parallel) draw the same numbers.
        with torch.device("meta"):
            self.model = K2Model(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if device.type != "meta":
            self.to_empty(device=device)
            if init_seed is None:
                init_seed = draw_init_seed()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_seed = init_seed
        # > 0: with labels, the loss runs over the vocabulary this many tokens at a time and no logits are
        # returned (model/chunked_loss.py); the trainer sets it from train.loss_chunk_tokens.
        self.loss_chunk_tokens = 0
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) for matrices, ones for norms, zeros for biases and router corrections,
        each tensor from its own generator seeded by (init_seed, name, expert): identical in any layout."""
        if self.init_seed is not None:
            init_weights(self, self.config, self.init_seed)

    # --------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        stats: ForwardStats | None = None,
        routing: RoutingTrace | None = None,
    ) -> CausalLMOutput:
        """input_ids [B, T]; labels [B, T] aligned with input_ids (HF style: shifted here, -100 ignored).

        `segment_ids` [B, T] (packed rows, e.g. SFT conversations) keeps attention causal and inside each
        segment (tokens sharing an id); pass `position_ids` restarting at 0 per segment with it. `stats`, a
        caller's collector, accumulates this call's records (max logits only if it tracks them); the output's
        aux_loss and tokens_per_expert cover this call alone. `routing`, a caller's RoutingTrace, records each
        token's experts and may replay given ones (R3, model/routing.py).
        """
        if segment_ids is not None:
            if attn_mask is not None:
                raise ValueError("pass either attn_mask or segment_ids, not both")
            attn_mask = segment_causal_mask(segment_ids)
        # A collector per call, so the output reports this call even when the caller's spans several.
        call = ForwardStats(self.config, track_max_logits=stats is not None and stats.track_max_logits)
        hidden = self.model(input_ids, position_ids, attn_mask, stats=call, routing=routing)
        chunked = labels is not None and self.loss_chunk_tokens > 0
        logits = None if chunked else self.lm_head(hidden)
        aux_loss = call.aux_loss()
        loss = None
        if labels is not None:
            # Shift the labels, not the logits: slicing [B, T, V] logits would copy them twice per step.
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
            if chunked:
                loss = chunked_cross_entropy(hidden.flatten(0, 1), self.lm_head.weight, targets.flatten(),
                                             chunk_tokens=self.loss_chunk_tokens)
            else:
                loss = cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
            if aux_loss is not None:
                loss = loss + aux_loss
        if stats is not None:
            stats.merge(call)
        return CausalLMOutput(logits=logits, loss=loss, aux_loss=aux_loss, tokens_per_expert=call.tokens_per_expert())

    # --------------------------------------------------------------- MoE helpers
    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    @torch.no_grad()
    def update_router_biases(self, tokens_per_expert: torch.Tensor, rate: float | None = None) -> None:
        """Aux-loss-free balancing step from accumulated counts [num_moe_layers, E] (sum over micro-batches)."""
        rate = self.config.bias_update_rate if rate is None else rate
        for moe, counts in zip(self.moe_layers(), tokens_per_expert, strict=True):
            moe.update_bias(rate, counts)

    # --------------------------------------------------------------- QK-Clip probe
    def attention_layers(self) -> list[MLAttention]:
        return [layer.self_attn for layer in self.model.layers]

    # --------------------------------------------------------------- checkpoints
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> K2ForCausalLM:
        """Load an HF-layout safetensors checkpoint (single or sharded, bf16/fp32 or block-FP8)."""
        from openk2.model.io import load_pretrained

        return load_pretrained(cls, path, dtype=dtype, device=device)

    def save_pretrained(self, path: str | Path, max_shard_bytes: int = 2 << 30) -> None:
        """Write HF-layout safetensors + config.json that transformers' DeepseekV3ForCausalLM loads."""
        from openk2.model.io import save_pretrained

        save_pretrained(self, path, max_shard_bytes=max_shard_bytes)
