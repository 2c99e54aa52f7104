"""Training FLOPs per token and a measured matmul ceiling, for tokens/s -> achieved FLOP/s -> MFU."""

from __future__ import annotations

import functools
import statistics
import time

import torch

from openk2.config import ModelConfig


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 x (matmul parameters one token touches) + causal attention scores and values (forward + 2x backward).

    Matmul parameters = activated parameters minus the embedding (a lookup, unless tied to lm_head), norms
    and the router bias.
    Attention: per layer and head, q.k over qk_head_dim and p.v over v_head_dim, 2 FLOPs per multiply-add,
    against seq_len/2 keys on average (causal), times 3 for forward plus backward.
    """
    count = cfg.num_params()
    bias = cfg.n_routed_experts * cfg.num_moe_layers
    # A tied embedding is also the lm_head matmul (its lm_head entry is then 0), so it stays in.
    embedding = 0 if cfg.tie_word_embeddings else count.breakdown["embedding"]
    matmul_params = count.activated - embedding - count.breakdown["norms"] - bias
    attention = 3 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    return 6.0 * matmul_params + attention * seq_len / 2


@functools.lru_cache(maxsize=8)
def measure_matmul_peak(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        size: int = 1024, repeats: int = 5) -> float:
    """Median FLOP/s of x @ W^T (nn.Linear's layout) in `dtype`: the ceiling MFU is measured against here.
    Measured once per process and arguments (experiments build many trainers)."""
    x = torch.randn(size, size, device=device).to(dtype)
    w = torch.randn(size, size, device=device).to(dtype)
    cuda = torch.device(device).type == "cuda"
    x @ w.t()  # warm-up (allocations, kernel selection)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        x @ w.t()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)
