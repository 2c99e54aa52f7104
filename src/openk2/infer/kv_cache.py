"""The paged latent KV cache: MLA's compressed rows [c, k^R] in fixed-size blocks, with prefix reuse.

MLA attends over a latent c = norm(kv_a(x)[:C]) and one roped key k^R shared by all heads, so the cache keeps
C + R numbers per token and layer instead of H * (qk_head_dim + v_head_dim) for a per-head K/V cache (K2: 576
vs 20,480, 35.6x less).

Layout: one tensor kv [L, num_blocks * block_size, C + R] (latent first, rope key last); block b holds rows
b * block_size .. (b + 1) * block_size - 1. A sequence owns a block table (a list of block ids) and its token at
position p lives in row table[p // block_size] * block_size + p % block_size. Blocks are reference counted and
handed out from a free list, so memory follows the tokens actually held, not max_seq_len per sequence.

Prefix reuse (as vLLM's automatic prefix caching): a full block is named by a hash chained over every token
before and in it, h_i = sha256(h_{i-1} || tokens of block i), so equal names mean equal prefixes (a latent
depends only on the tokens up to it). Full blocks are registered under their name; a new sequence whose prompt
starts with registered blocks shares them (reference count + 1) and computes only the rest. A block whose last
user leaves keeps its contents and name on an LRU list and is reclaimed only when the free list is empty.
Shape legend: L layers, C kv_lora_rank, R qk_rope_head_dim, B batch, S positions read, M rows written.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

import torch

from openk2.config import ModelConfig

ROOT_HASH = b""  # the name of the empty prefix


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chained name of a full block: sha256 over its parent's name and its token ids (int64)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def prefix_hashes(tokens: Sequence[int], block_size: int, num_blocks: int | None = None) -> list[bytes]:
    """Names of the first `num_blocks` full blocks of `tokens` (all full blocks when None)."""
    full = len(tokens) // block_size if num_blocks is None else num_blocks
    out, parent = [], ROOT_HASH
    for i in range(full):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


class PagedLatentCache:
    """Block storage, a free list, reference counts and the prefix table; the engine owns the block tables."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_layers = cfg.num_hidden_layers
        self.kv_lora_rank = cfg.kv_lora_rank
        self.rope_dim = cfg.qk_rope_head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.kv = torch.zeros(self.num_layers, num_blocks * block_size, width, dtype=dtype, device=device)
        self.refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # blocks holding nothing worth keeping
        self._idle: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks that keep a prefix (LRU first)
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.hits = 0  # blocks the engine reused from the prefix table (a counter for tests and benchmarks)

    # ------------------------------------------------------------------ sizes
    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, from the cache tensor itself."""
        return self.kv.nbytes // (self.num_blocks * self.block_size)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: free ones plus unreferenced cached ones."""
        return len(self._free) + len(self._idle)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ blocks
    def allocate(self) -> int:
        """A block for one new user: from the free list, else the least recently used cached block."""
        if self._free:
            block = self._free.popleft()
        elif self._idle:
            block, _ = self._idle.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        else:
            raise RuntimeError("the KV cache is out of blocks")  # the engine's admission rule prevents this
        self.refs[block] = 1
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced blocks keep their prefix (if named) until reclaimed."""
        for block in blocks:
            self.refs[block] -= 1
            assert self.refs[block] >= 0, f"block {block} released twice"
            if self.refs[block] == 0:
                if block in self._hash_of:
                    self._idle[block] = None
                else:
                    self._free.append(block)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Take a reference to the registered blocks of the longest prefix of `hashes`; returns them in order."""
        out = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            if self.refs[block] == 0:
                del self._idle[block]
            self.refs[block] += 1
            out.append(block)
        return out

    def register(self, block: int, h: bytes) -> None:
        """Name a full block by its prefix hash (a name already taken keeps its first block)."""
        if h not in self._by_hash and block not in self._hash_of:
            self._by_hash[h] = block
            self._hash_of[block] = h

    def forget_prefixes(self) -> None:
        """Unname every block (after a weight update the cached latents are stale); idle blocks become free."""
        self._by_hash.clear()
        self._hash_of.clear()
        self._free.extend(self._idle)
        self._idle.clear()

    def copy_block(self, src: int, dst: int, rows: int) -> None:
        """Copy the first `rows` rows of block `src` into block `dst` (copy-on-write of a partial block)."""
        a, b = src * self.block_size, dst * self.block_size
        self.kv[:, b:b + rows].copy_(self.kv[:, a:a + rows])

    # ------------------------------------------------------------------ rows
    def rows(self, table: Sequence[int], start: int, stop: int) -> list[int]:
        """Cache rows of positions start..stop-1 of a sequence with block table `table`."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]

    def write(self, layer: int, rows_M: torch.Tensor, values_MX: torch.Tensor) -> None:
        """Store values [M, C+R] at cache rows rows_M of `layer` (callers keep rows in range: checking here would
        sync a GPU once per layer)."""
        self.kv[layer].index_copy_(0, rows_M, values_MX.to(self.kv.dtype))

    def read(self, layer: int, rows_BS: torch.Tensor) -> torch.Tensor:
        """Gather rows [B, S] of `layer`: [B, S, C+R]."""
        return self.kv[layer][rows_BS]

    def latent(self, kv: torch.Tensor) -> torch.Tensor:
        """The latent c [..., C] of a tensor read from this cache."""
        return kv[..., : self.kv_lora_rank]

    def rope_key(self, kv: torch.Tensor) -> torch.Tensor:
        """The roped shared key k^R [..., R] of a tensor read from this cache."""
        return kv[..., self.kv_lora_rank:]
