"""Training FLOPs per token from the config, checked against a count of a built model's matmul weights."""

import torch

from openk2 import K2ForCausalLM, ModelConfig
from openk2.train.flops import measure_matmul_peak, training_flops_per_token


def test_flops_per_token_counts_touched_matmul_weights():
    cfg = ModelConfig.preset("tiny")
    model = K2ForCausalLM(cfg)
    matmul = 0
    for name, p in model.named_parameters():
        if p.ndim < 2 or "embed_tokens" in name:
            continue
        if ".experts." in name:  # stacked routed experts: a token touches k of them
            matmul += p[0].numel() * cfg.num_experts_per_tok
        else:
            matmul += p.numel()
    attention = 3 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * 128
    assert training_flops_per_token(cfg, 256) == 6 * matmul + attention


def test_matmul_peak_is_positive():
    assert measure_matmul_peak(torch.float32, size=128, repeats=2) > 0


def test_tied_embedding_counts_once_as_the_output_matmul():
    cfg = ModelConfig.preset("tiny")
    tied = cfg.replace(tie_word_embeddings=True)
    # Untied: lm_head counted, embedding lookup not; tied: the shared matrix counted once, as lm_head.
    assert training_flops_per_token(tied, 256) == training_flops_per_token(cfg, 256)
