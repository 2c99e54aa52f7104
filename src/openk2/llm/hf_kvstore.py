"""`PrefixKVStore`: the KV of prompt heads kept across `generate` calls, keyed by tokens, LRU-bounded by bytes.

Synthesis sends the same long prompt heads in batch after batch (an agent's system prompt and tool list in every
episode, a task's judge instruction), and `openk2.llm.hf_prefix` prefills a head once per batch. The store keeps
each head's keys and values (per layer, shape (1, kv_heads, L, head_dim), positions 0..L-1 of an unpadded
prompt) after it was computed, so a later batch reuses them. KV at position i depends only on tokens 0..i
(causal attention), so any stored key that shares its first `c` tokens with a prompt serves that prompt's first
`c` positions (`longest`), even when the two prompts differ after them.

Memory is bounded: `max_bytes` covers every stored tensor; adding an entry evicts the least recently used ones
until the total fits, and an entry larger than the whole budget is not stored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from openk2.llm.hf_prefix import common_prefix

KV = list[tuple[Any, Any]]  # per layer: (keys, values), each (1, kv_heads, L, head_dim)


def kv_bytes(kv: KV) -> int:
    """Bytes held by the tensors of `kv`."""
    return sum(t.numel() * t.element_size() for layer in kv for t in layer)


class PrefixKVStore:
    """Token prefix -> its KV; `longest(prompt)` finds the stored head sharing the most leading tokens."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], tuple[KV, int]] = OrderedDict()  # oldest use first
        self.bytes = 0
        self.stats = {"hits": 0, "misses": 0, "hit_tokens": 0, "evicted": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[tuple[int, ...]]:
        """Stored token prefixes, least recently used first."""
        return list(self._entries)

    def longest(self, prompt: Sequence[int], limit: int) -> tuple[int, KV | None]:
        """(c, kv): the most leading tokens of `prompt` (at most `limit`) some entry holds, and that entry's KV
        (valid for its first `c` positions); (0, None) when none shares a token. A hit counts as a use."""
        best, best_key = 0, None
        for key in self._entries:
            c = min(common_prefix(key, prompt), limit)
            if c > best:
                best, best_key = c, key
        if best_key is None:
            self.stats["misses"] += 1
            return 0, None
        self._entries.move_to_end(best_key)
        self.stats["hits"] += 1
        self.stats["hit_tokens"] += best
        return best, self._entries[best_key][0]

    def put(self, tokens: Sequence[int], kv: KV) -> bool:
        """Store `kv` (covering exactly `tokens`) and evict the least recently used entries until the total fits
        `max_bytes`; False (nothing stored) when the entry alone is larger than the budget."""
        key = tuple(tokens)
        size = kv_bytes(kv)
        if size > self.max_bytes:
            return False
        if key in self._entries:
            self.bytes -= self._entries.pop(key)[1]
        self._entries[key] = (kv, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, old) = self._entries.popitem(last=False)
            self.bytes -= old
            self.stats["evicted"] += 1
        return True
