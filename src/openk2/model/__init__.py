"""The Kimi K2 model: MLA attention, sparse MoE, HF-compatible checkpoints."""

from openk2.model.stats import ForwardStats
from openk2.model.transformer import CausalLMOutput, K2ForCausalLM

__all__ = ["CausalLMOutput", "ForwardStats", "K2ForCausalLM"]
