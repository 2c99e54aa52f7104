"""Activation bytes a training forward keeps for backward, counted from the model's shapes (no tensors built).

Per token and decoder layer, the tensors autograd saves in openk2's layers (model/attention.py, moe.py, layers.py),
listed by reading what `saved_tensors_hooks` receive on a real forward:

* RMSNorm: its fp32 input, rsqrt (1 per token), the normalised input and the output the next matmul reads;
* MLA: q_a output and its norm, the kv latent and its norm, per-head q and k (N+R each) and v, the attention
  core's saves (`short_attention`, CPU bf16 up to SHORT_MAX_KEYS keys: fp32 probabilities, H x S per token, and
  the output; the fused kernels: v padded to the q/k head dim, the output and a log-sum-exp per head), the
  attention output o_proj reads;
* SwiGLU (dense MLP, shared expert): gate and up outputs, silu(gate) and the product down reads;
* MoE: router scores (fp32) and chosen indices/weights; per routed (token, slot) row: the gathered input, the
  expert SwiGLU's four tensors, the output and its weighted copy, two int64 row indices; with ep > 1 also the
  received rows and their expert-sorted copy; aligned expert rows (CPU bf16, model/moe.py) add zero rows, at
  most CPU_ALIGN_ROWS - 1 per expert and forward, planned at that bound;
* bf16 autocast over fp32 weights: each matmul keeps its own bf16 copy of an fp32 input (the residual norms'
  outputs, the router's fp32 copy) and of its weight (per forward, not per token: `layer_weight_copies`);
* the head: final norm, logits and the loss's per-token log-sum-exp and target (model/fused_loss.py).

Memory options (train/memory.py) change the saved set: "full" recompute keeps each layer's fp32 input (no FP8 there);
"selective" keeps the layer input and the outputs of kept matmuls/attention kernels (not q_b/kv_b/down
projections); FP8 stores SwiGLU block inputs and gate/up outputs in 1 byte (+ one fp32 scale per 128); offload
moves what remains to the host. Under recompute, backward re-materialises one layer at a time, so one layer's
plain activations are added as a transient. Validated against a measured forward on CPU
(tests/train/parallel/test_plan.py; the tolerance and the numbers are in docs/parallelism.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from openk2.config import ModelConfig
from openk2.train.memory import MemorySection

FP8_TILE = 128  # train/memory.py: 1 x 128 tiles, the last dim zero-padded to a whole tile


def fp8_bytes(width: int) -> int:
    """Bytes of one row of `width` values stored as FP8 tiles: padded e4m3 values + one fp32 scale per tile."""
    tiles = -(-width // FP8_TILE)
    return tiles * (FP8_TILE + 4)


@dataclass(frozen=True)
class ActivationModel:
    """Bytes per token of one layer (or the head) under given options; `a` is the compute dtype's size."""

    config: ModelConfig
    memory: MemorySection
    act_bytes: int = 4  # 4: fp32 compute; 2: bf16 autocast (matmul outputs bf16, norms still fp32)
    flash_attention: bool = False  # True: a fused kernel (model/attention_core.py, CPU and GPU); False: math
    seq_len: int = 1
    ep: int = 1
    short_attention: bool = False  # True: `short_attention` (attention_core.short_path_rule): fp32 probabilities
    autocast: bool = False  # True: bf16 autocast over fp32 weights (bf16 copies of fp32 matmul inputs, weights)
    expert_pad_rows: float = 0.0  # zero rows per token the aligned experts add (model/moe.py pads_expert_rows)

    # ------------------------------------------------------------------ pieces
    def _norm(self, width: int) -> float:
        return 4 * width + 4 + 2 * self.act_bytes * width

    def _attention(self, plain: bool = True) -> float:
        c, a = self.config, self.act_bytes
        h, qk, v = c.num_attention_heads, c.qk_head_dim, c.v_head_dim
        inner = a if self.autocast else 4  # under autocast the low-rank norms read bf16 matmul outputs
        q_path = inner * c.q_lora_rank + 4 + 2 * a * c.q_lora_rank if c.q_lora_rank else 0
        kv = inner * (c.kv_lora_rank + c.qk_rope_head_dim) + 4 + 2 * a * c.kv_lora_rank
        # Fused kernels see v zero-padded to the q/k head dim (model/attention_core.py): their saved v and output
        # are that wide, plus the per-head log-sum-exp; the short path keeps fp32 T x S probabilities and its
        # output; the math path the T x T probabilities.
        wide = max(qk, v)
        if self.short_attention:
            core = 4 * h * self.seq_len + a * h * v
        elif self.flash_attention:
            core = a * h * wide + 4 * h + a * h * (wide - v)
        else:
            core = a * h * self.seq_len
        casts = 2 * a * c.hidden_size if self.autocast else 0  # q_a (or q) and kv_a read the fp32 norm output
        return q_path + kv + 2 * a * h * qk + a * h * v + core + a * h * v + casts

    def _swiglu(self, width: int, rows: float = 1.0) -> float:
        """gate, up, silu(gate), product: 4 tensors of `width` per row (FP8 stores gate and up)."""
        a = self.act_bytes
        if self.memory.fp8_saves:
            return rows * (2 * fp8_bytes(width) + 2 * a * width)
        return rows * 4 * a * width

    def _moe(self) -> float:
        c, a = self.config, self.act_bytes
        k, d = c.num_experts_per_tok, c.hidden_size
        router = 4 * c.n_routed_experts + 8 * k + 4 + 4 * k + (4 * d if self.autocast else 0)  # + its fp32 copy
        row_input = fp8_bytes(d) if self.memory.fp8_saves else a * d
        rows = k + self.expert_pad_rows
        routed = rows * (row_input + 2 * a * d + 4 + 16) + self._swiglu(c.moe_intermediate_size, rows)
        if self.ep > 1:
            routed += 2 * a * k * d  # received rows and their expert-sorted copy
        shared = self._swiglu(c.moe_intermediate_size * c.n_shared_experts)
        if self.autocast and c.n_shared_experts:
            shared += 2 * a * d  # gate and up read the fp32 norm output
        if self.memory.fp8_saves and not self.autocast:  # its input's FP8 copy, beside the router's
            shared += fp8_bytes(d)  # (autocast: gate and up read bf16 copies, not the input the hooks quantise)
        return router + routed + shared

    def _selective(self, moe: bool) -> float:
        """Selective recompute keeps the layer input and the kept matmul / attention-kernel outputs."""
        c, a = self.config, self.act_bytes
        h = c.num_attention_heads
        kept = 4 * c.hidden_size + a * (c.q_lora_rank or 0) + a * (c.kv_lora_rank + c.qk_rope_head_dim)
        wide = max(c.qk_head_dim, c.v_head_dim)  # a fused kernel's output is as wide as its padded v
        if not self.short_attention:  # short_attention's matmuls run without grad (an autograd.Function): none kept
            kept += (a * h * wide + 4 * h) if self.flash_attention else a * h * (self.seq_len + c.v_head_dim)
        kept += a * c.hidden_size  # o_proj output
        fp8 = self.memory.fp8_saves
        # The policy keeps a SwiGLU gate/up output only if the matmul reads the block input itself; under autocast
        # the dense MLP and shared expert read a bf16 copy of their fp32 input, so none is kept (train/memory.py),
        # and the FP8 hooks quantise no copy of that input either.
        reads_input = 0 if self.autocast else 1
        if moe:
            k, d, i = c.num_experts_per_tok + self.expert_pad_rows, c.hidden_size, c.moe_intermediate_size
            s = i * c.n_shared_experts
            kept += 4 * c.n_routed_experts  # the router's fp32 matmul
            kept += k * (fp8_bytes(d) + 2 * fp8_bytes(i)) if fp8 else 2 * a * k * i
            kept += fp8_bytes(d) * reads_input + 2 * fp8_bytes(s) if fp8 else 2 * a * s * reads_input
        else:
            d, i = c.hidden_size, c.intermediate_size
            kept += fp8_bytes(d) * reads_input + 2 * fp8_bytes(i) if fp8 else 2 * a * i * reads_input
        return kept

    # ------------------------------------------------------------------ per token
    def plain_layer(self, moe: bool) -> float:
        """Bytes per token one decoder layer keeps with no recompute."""
        c = self.config
        mlp = self._moe() if moe else self._swiglu(c.intermediate_size)
        if self.autocast and not moe:  # gate and up read the fp32 norm output: a bf16 copy each
            mlp += 2 * self.act_bytes * c.hidden_size
        if self.memory.fp8_saves and not moe and not self.autocast:  # autocast: see _moe
            mlp += fp8_bytes(c.hidden_size) - self.act_bytes * c.hidden_size  # the block input in FP8
        return 2 * self._norm(c.hidden_size) + self._attention() + mlp

    def layer(self, moe: bool) -> float:
        """Bytes per token one decoder layer keeps under the configured options (on the device)."""
        mode = self.memory.recompute
        if mode == "full":  # the layer input (FP8 is off under full recompute: MemorySection.fp8_saves)
            kept = 4.0 * self.config.hidden_size
        elif mode == "selective":
            kept = self._selective(moe)
        else:
            kept = self.plain_layer(moe)
        if self.memory.cpu_offload and mode == "selective":  # offload moves the layer input, not the cache
            kept = self._selective(moe) - 4.0 * self.config.hidden_size
        elif self.memory.cpu_offload:  # FP8 tiles stay on the device
            kept = self._fp8_tiles(moe)
        return kept

    def _fp8_tiles(self, moe: bool) -> float:
        """Per token: a layer's FP8 tiles (SwiGLU block inputs, gate and up outputs), which offload never moves."""
        if not self.memory.fp8_saves:
            return 0.0
        c = self.config
        block_input = 0 if self.autocast else fp8_bytes(c.hidden_size)  # the dense/shared block input (see _moe)
        if not moe:
            return 2 * fp8_bytes(c.intermediate_size) + block_input
        rows = c.num_experts_per_tok + self.expert_pad_rows
        routed = rows * (fp8_bytes(c.hidden_size) + 2 * fp8_bytes(c.moe_intermediate_size))
        return routed + 2 * fp8_bytes(c.moe_intermediate_size * c.n_shared_experts) + block_input

    def head(self) -> float:
        """Final norm, logits and the loss's saves per token: fp32 log-sum-exp, int64 target, bool mask; under
        offload only the logits, which the returned output keeps on the device."""
        v = self.config.vocab_size
        if self.memory.cpu_offload:
            return self.act_bytes * v
        cast = self.act_bytes * self.config.hidden_size if self.autocast else 0  # lm_head's bf16 input
        return self._norm(self.config.hidden_size) + cast + self.act_bytes * v + 4 + 8 + 1

    def layer_weight_copies(self, moe: bool) -> int:
        """Bytes per forward (not per token) a layer's graph keeps of bf16 autocast copies of its fp32 matmul
        weights (0 without autocast, or when recompute or offload leaves them out of the saved set)."""
        mem = self.memory
        if not self.autocast or mem.recompute != "none" or mem.cpu_offload:
            return 0
        c = self.config
        h, d = c.num_attention_heads, c.hidden_size
        q = (d * c.q_lora_rank + c.q_lora_rank * h * c.qk_head_dim) if c.q_lora_rank else d * h * c.qk_head_dim
        kv = d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
        attention = q + kv + h * c.v_head_dim * d
        if moe:
            experts = c.n_routed_experts // self.ep + c.n_shared_experts
            mlp = 3 * d * c.moe_intermediate_size * experts
        else:
            mlp = 3 * d * c.intermediate_size
        return 2 * (attention + mlp)

    def head_weight_copy(self) -> int:
        """Bytes per forward of the lm_head weight's bf16 autocast copy (0 without autocast)."""
        return 2 * self.config.vocab_size * self.config.hidden_size if self.autocast else 0

    def recompute_transient(self, moe: bool) -> float:
        """Per token: the one layer a recomputing backward re-materialises at a time (0 without recompute)."""
        return self.plain_layer(moe) if self.memory.recompute != "none" else 0.0
