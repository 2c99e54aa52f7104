"""The tiny random K2 checkpoint the server, llm and eval tests share: built once per session (the suite's
conftest registers the fixture, so every module gets the same directory; a session fixture imported into a test
module is built again for each module that imports it)."""

from __future__ import annotations

from pathlib import Path

import pytest

HELLO_TEXT = "Hello, how are you? The weather in Paris is sunny."


def write_tiny_checkpoint(out: Path, texts: list[str]) -> Path:
    """A tiny random K2 checkpoint at `out` with a tokenizer trained on math documents plus `texts`."""
    import torch

    from openk2.config import ModelConfig
    from openk2.data.mathgen import math_documents
    from openk2.data.tokenizer import train_tokenizer
    from openk2.model import K2ForCausalLM

    tok = train_tokenizer(list(math_documents(seed=0, count=200)) + texts * 20, vocab_size=768)
    cfg = ModelConfig.preset("tiny").replace(
        vocab_size=768, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, n_routed_experts=8)
    torch.manual_seed(0)
    K2ForCausalLM(cfg).save_pretrained(out)
    tok.save(out)
    return out


@pytest.fixture(scope="session")
def tiny_k2_checkpoint(tmp_path_factory) -> Path:
    """A tiny random K2 checkpoint with a locally trained tokenizer (K2 special tokens included); read-only."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-k2", [HELLO_TEXT])
