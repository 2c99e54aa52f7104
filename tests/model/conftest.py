"""Random small configs and helpers shared by the model tests."""

from __future__ import annotations

import pytest
import torch

from openk2.config import ModelConfig


def small_config(**overrides) -> ModelConfig:
    """A few-layer config with every K2 feature switched on (YaRN, MLA low-rank q, 1 dense layer, MoE)."""
    base = dict(
        vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, max_position_embeddings=256, rope_theta=50000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    base.update(overrides)
    return ModelConfig(**base)


@torch.no_grad()
def randomise_extras(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial norm weights and router correction biases (init leaves them at 1 and 0)."""
    g = torch.Generator().manual_seed(seed)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            tensor.copy_(1 + 0.3 * torch.randn(tensor.shape, generator=g))
        elif name.endswith("e_score_correction_bias"):
            tensor.copy_(0.1 * torch.randn(tensor.shape, generator=g))


@pytest.fixture
def tiny_config() -> ModelConfig:
    return small_config()
