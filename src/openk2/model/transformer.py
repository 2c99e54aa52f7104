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
from openk2.model.attention import MLAttention, segment_causal_mask
from openk2.model.layers import MLP, RMSNorm
from openk2.model.moe import MoE
from openk2.model.rope import RotaryEmbedding


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, V]
    loss: torch.Tensor | None = None  # mean next-token cross-entropy (+ aux_loss when present)
    aux_loss: torch.Tensor | None = None  # sum of the MoE layers' sequence-wise balance losses
    tokens_per_expert: torch.Tensor | None = None  # [num_moe_layers, E] routed (token, slot) counts this call


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, attn_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class K2Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(self, input_ids, position_ids=None, attn_mask=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        cos, sin = self.rotary_emb(position_ids)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn_mask)
        return self.norm(x)


class K2ForCausalLM(nn.Module):
    """Kimi K2 / DeepSeek-V3 (main model) causal LM."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = K2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) for matrices, ones for norms, zeros for biases and router corrections."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, MoE):
                nn.init.normal_(module.gate.weight, std=std)
                nn.init.zeros_(module.gate.e_score_correction_bias)
                for w in (module.experts.gate_proj, module.experts.up_proj, module.experts.down_proj):
                    nn.init.normal_(w, std=std)

    # --------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """input_ids [B, T]; labels [B, T] aligned with input_ids (HF style: shifted here, -100 ignored).

        `segment_ids` [B, T] (packed rows, e.g. SFT conversations) keeps attention causal and inside each
        segment (tokens sharing an id); pass `position_ids` restarting at 0 per segment with it.
        """
        if segment_ids is not None:
            if attn_mask is not None:
                raise ValueError("pass either attn_mask or segment_ids, not both")
            attn_mask = segment_causal_mask(segment_ids)
        moe_layers = self.moe_layers()
        for moe in moe_layers:
            moe.tokens_per_expert.zero_()
        hidden = self.model(input_ids, position_ids, attn_mask)
        logits = self.lm_head(hidden)
        aux = [moe.aux_loss for moe in moe_layers if moe.aux_loss is not None]
        aux_loss = torch.stack(aux).sum() if aux else None
        loss = None
        if labels is not None:
            # Shift the labels, not the logits: slicing [B, T, V] logits would copy them twice per step.
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
            if aux_loss is not None:
                loss = loss + aux_loss
        counts = torch.stack([m.tokens_per_expert.clone() for m in moe_layers]) if moe_layers else None
        return CausalLMOutput(logits=logits, loss=loss, aux_loss=aux_loss, tokens_per_expert=counts)

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

    def track_max_logits(self, enabled: bool = True) -> None:
        """Record each head's max scaled, masked pre-softmax logit on every forward (off by default)."""
        for attn in self.attention_layers():
            attn.track_max_logits = enabled
            attn.max_logits = None

    def pop_max_logits(self) -> torch.Tensor:
        """The per-head max logits [L, H] (fp32) accumulated since the last pop; resets them."""
        rows = []
        for attn in self.attention_layers():
            if attn.max_logits is None:
                rows.append(torch.full((attn.num_heads,), float("-inf")))
            else:
                rows.append(attn.max_logits.detach().float().cpu())
            attn.max_logits = None
        return torch.stack(rows)

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
