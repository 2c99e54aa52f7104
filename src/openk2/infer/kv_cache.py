"""The MLA latent KV cache: per layer and token, the normalised latent c and the roped shared key k^R.

MLA's keys and values are functions of the compressed latent c (kv_lora_rank numbers) plus one rope key k^R
shared by all heads (qk_rope_head_dim numbers), so that is all a cache needs to hold: C + R numbers per token per
layer instead of H * (qk_head_dim + v_head_dim) for a per-head K/V cache (K2: 576 vs 20,480, 35.6x less).

Layout: one tensor kv [L, slots, S, C + R] (latent first, rope key last), preallocated for `max_batch_size`
slots of `max_seq_len` positions. A sequence lives in one slot, its tokens at positions 0..length-1
("right padding": a slot's unused tail is never read, because attention masks keys at positions >= length).
Shape legend: L layers, S positions, C kv_lora_rank, R qk_rope_head_dim.
"""

from __future__ import annotations

import torch

from openk2.config import ModelConfig


class LatentKVCache:
    """Preallocated latent cache with a per-slot length; the engine owns slot assignment."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if max_batch_size <= 0 or max_seq_len <= 0:
            raise ValueError(f"max_batch_size and max_seq_len must be positive, got {max_batch_size}, {max_seq_len}")
        self.num_layers = cfg.num_hidden_layers
        self.kv_lora_rank = cfg.kv_lora_rank
        self.rope_dim = cfg.qk_rope_head_dim
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.kv = torch.zeros(self.num_layers, max_batch_size, max_seq_len, width, dtype=dtype, device=device)
        self.lengths = [0] * max_batch_size  # tokens held per slot (host-side: no device syncs to read it)

    # ------------------------------------------------------------------ sizes
    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, from the cache tensor itself."""
        return self.kv.nbytes // (self.max_batch_size * self.max_seq_len)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    # ------------------------------------------------------------------ access
    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Store values [M, C+R] for M tokens at (slots[m], positions[m]) of `layer` (callers keep positions in
        range: checking here would sync a GPU once per layer)."""
        self.kv[layer].index_put_((slots, positions), values.to(self.kv.dtype))

    def read(self, layer: int, slots: torch.Tensor | slice, length: int) -> torch.Tensor:
        """The first `length` positions of `slots`: [B, length, C+R]; a view (no copy) when slots is a slice."""
        return self.kv[layer][slots, :length]

    def latent(self, kv: torch.Tensor) -> torch.Tensor:
        """The latent c [..., C] of a tensor read from this cache."""
        return kv[..., : self.kv_lora_rank]

    def rope_key(self, kv: torch.Tensor) -> torch.Tensor:
        """The roped shared key k^R [..., R] of a tensor read from this cache."""
        return kv[..., self.kv_lora_rank:]

    # ------------------------------------------------------------------ slots
    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Duplicate the first `length` positions of slot `src` into slot `dst` (shared prompt for n samples)."""
        if length > self.max_seq_len:
            raise IndexError(f"length {length} is beyond max_seq_len={self.max_seq_len}")
        self.kv[:, dst, :length].copy_(self.kv[:, src, :length])
        self.lengths[dst] = length

    def free(self, slot: int) -> None:
        """Forget a slot's contents (its stale values stay but are never read: reads stop at its length)."""
        self.lengths[slot] = 0

