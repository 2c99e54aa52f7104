"""`growing_cache`: a transformers KV cache that appends a decode step in place instead of copying the cache.

transformers' `DynamicLayer.update` concatenates (`torch.cat`) the whole cache with each step's keys and values,
so a decode step copies every layer's cache once: O(length) memory traffic per layer and step. In a profile of
batched SmolLM2 decoding on this project's CPU (batch 8, 300 tokens of context) `aten::cat` was a third of the
step. `GrowingLayer` keeps keys and values in a buffer with spare room along the sequence (`reserve` positions
after the first fill, so a `generate` that reserves its `max_new_tokens` never copies; half again when full) and
hands attention a view of the filled part; the values are the same, so outputs are too. Any
method that replaces the tensors (`batch_select_indices`, `crop`, ...) works on the view; the next append then
finds the view detached from its buffer and starts a new one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose `update` writes into spare room of a buffer (see the module docstring)."""

    def __init__(self, reserve: int = 64) -> None:
        super().__init__()
        self.reserve = reserve  # extra positions allocated beyond the first fill
        self._bufs: tuple[Any, Any] | None = None

    def _attached(self) -> bool:
        """Whether `keys`/`values` are still the filled prefix of this layer's buffers."""
        if self._bufs is None or self.keys.numel() == 0:
            return False
        kb, vb = self._bufs
        return (self.keys.data_ptr() == kb.data_ptr() and self.values.data_ptr() == vb.data_ptr()
                and self.keys.shape[:2] == kb.shape[:2] and self.keys.stride() == kb.stride())

    def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, add = self.get_seq_length(), key_states.shape[-2]
        if not self._attached() or n + add > self._bufs[0].shape[-2]:
            cap = n + add + (self.reserve if n == 0 else max(self.reserve, (n + add) // 2))
            kb = key_states.new_empty((*key_states.shape[:2], cap, key_states.shape[-1]))
            vb = value_states.new_empty((*value_states.shape[:2], cap, value_states.shape[-1]))
            if n:
                kb[:, :, :n] = self.keys
                vb[:, :, :n] = self.values
            self._bufs = (kb, vb)
        kb, vb = self._bufs
        kb[:, :, n:n + add] = key_states
        vb[:, :, n:n + add] = value_states
        self.keys, self.values = kb[:, :, :n + add], vb[:, :, :n + add]
        return self.keys, self.values


class GrowingCache(DynamicCache):
    """A `DynamicCache` made of `GrowingLayer`s (`growing_cache` builds one)."""

    def __init__(self, layers: list[GrowingLayer] | None = None) -> None:
        if layers:
            Cache.__init__(self, layers=layers)
        else:
            Cache.__init__(self, layer_class_to_replicate=GrowingLayer)


def growing_cache(kv: Sequence[tuple[Any, Any]] | None = None, reserve: int = 64,
                  num_layers: int | None = None) -> GrowingCache:
    """A `GrowingCache` holding `kv` (per layer: keys, values of shape (batch, heads, len, dim)), or an empty one
    of `num_layers` layers (layers made as needed when None), each with room for `reserve` more tokens."""
    if not kv:
        return GrowingCache([GrowingLayer(reserve) for _ in range(num_layers)] if num_layers else None)
    layers = []
    for keys, values in kv:
        layer = GrowingLayer(reserve)
        layer.update(keys, values)
        layers.append(layer)
    return GrowingCache(layers)
