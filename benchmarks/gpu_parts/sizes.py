"""The model sizes the GPU check uses: a small all-features config for the correctness checks, and the K2-shaped
config the benchmarks time (full on CUDA, cut down with --quick so the CPU dry run takes seconds)."""

from __future__ import annotations

from dataclasses import dataclass

from openk2 import ModelConfig

# Dense bf16 tensor-core peak by the vendor's datasheet (SXM parts, no sparsity), FLOP/s. MFU is stated against
# this and, separately, against the bf16 matmul ceiling measured in the same run.
DATASHEET_BF16_PEAK = {"H200": 989.4e12, "H100 80GB HBM3": 989.4e12, "H100 SXM": 989.4e12, "H100 PCIe": 756.0e12}


def datasheet_peak(device_name: str) -> tuple[float | None, str]:
    """(dense bf16 peak FLOP/s, where it comes from) for a CUDA device name; None where the name is not listed."""
    for key, peak in DATASHEET_BF16_PEAK.items():
        if key in device_name:
            return peak, f"{key} datasheet, dense bf16 without sparsity"
    return None, f"no datasheet entry for {device_name!r}"


def check_config() -> ModelConfig:
    """Three layers (1 dense, 2 MoE) with every K2 feature on: low-rank q, YaRN, interleaved rope, shared expert."""
    return ModelConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, max_position_embeddings=1024, rope_theta=50000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    )  # fmt: skip


@dataclass(frozen=True)
class BenchSizes:
    """What the benchmark parts time: the model, the training batch, the probe lengths, the decode grid."""

    model: ModelConfig
    batch: int
    seq_len: int
    probe_lengths: tuple[int, ...]
    probe_heads: int
    decode_batches: tuple[int, ...]
    decode_prompts: tuple[int, ...]
    new_tokens: int
    repeats: int


def k2_shaped(quick: bool) -> ModelConfig:
    """Kimi K2's config (head dims 192/128, 1 dense layer first, sigmoid top-8 routing, YaRN) at a width that
    fits one GPU twice over (ours and HF side by side); --quick: the same shape scaled down for a CPU."""
    base = ModelConfig.preset("kimi-k2").replace(aux_loss_alpha=0.0, bos_token_id=None, eos_token_id=None)
    if quick:
        return base.replace(
            vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
        )  # fmt: skip
    # ~1.7B parameters (5 MoE layers of 64 experts), ~0.3B activated per token: 3.4 GB of bf16 weights per model.
    return base.replace(
        vocab_size=32768, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=768, num_hidden_layers=6,
        num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512, n_routed_experts=64, num_experts_per_tok=8,
    )  # fmt: skip


def bench_sizes(quick: bool) -> BenchSizes:
    """The benchmark sizes for a full GPU run or a --quick dry run."""
    if quick:
        return BenchSizes(k2_shaped(True), batch=2, seq_len=64, probe_lengths=(128, 256), probe_heads=2,
                          decode_batches=(1, 2), decode_prompts=(16, 32), new_tokens=4, repeats=2)
    return BenchSizes(k2_shaped(False), batch=2, seq_len=4096, probe_lengths=(4096, 16384), probe_heads=16,
                      decode_batches=(1, 8, 64), decode_prompts=(256, 4096), new_tokens=32, repeats=3)
