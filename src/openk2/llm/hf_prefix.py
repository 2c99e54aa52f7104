"""Shared-prefix prefill for a batched `generate`: prompts that start alike are prefilled once per group.

Concurrent synthesis calls repeat long prompt heads (one agent's system prompt and tool list in every episode of
its tasks, one judge instruction per task), and on a CPU prefill costs about as much per token as decoding. So
`plan_prefixes` groups a batch's prompts by common prefix (sorted, adjacent prompts sharing at least
`min_shared` tokens), `prefill` runs each group's prefix once (left-padded to the longest prefix) and copies its
KV rows to the group's members, and `generate` gets the full layout

    [pad .. group prefix][pad .. rest of the prompt]   with attention 0 on every pad

plus that cache, so it only prefills the rests. Positions come from the attention mask (cumsum - 1), as
transformers computes them for left padding, so a row sees the same positions and keys as its unshared prompt:
greedy outputs equal the plain batch's (tested). A prompt in no group has an empty prefix, unless a
`PrefixKVStore` (`openk2.llm.hf_kvstore`) passed to `prefill` holds a head of it: the store keeps every group
head computed here, so later batches reuse heads across `generate` calls. Each head is computed unpadded at
batch 1 (its positions 0..L-1) with only the last position's logits, then copied into the batch's cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# about what one extra batch-1 forward costs in prompt tokens: SmolLM2 on this CPU reads its weights in ~0.15 s
# (a decode step at batch 3), a prompt token costs ~3.4 ms (the CI-sized run's prefill)
ROW_OVERHEAD = 48


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class PrefixPlan:
    """Per row: its group (-1: none) and shared-prefix length; per group: the prefix length."""

    group: list[int]
    cut: list[int]
    group_len: list[int]

    @property
    def shared_tokens(self) -> int:
        """Prompt tokens not prefilled again thanks to sharing (sum over rows, minus one prefill per group)."""
        return sum(self.cut) - sum(self.group_len)


def plan_prefixes(prompts: Sequence[Sequence[int]], min_shared: int = 16) -> PrefixPlan:
    """Group `prompts` by shared prefix (at least `min_shared` tokens; every row keeps one token of its own); a
    prompt joins the group before it (in sorted order) when that does not lower the tokens the group saves."""
    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))
    groups: list[list[int]] = []
    lens: list[int] = []
    for i in order:
        if groups:
            head = prompts[groups[-1][0]]
            shared = min(common_prefix(head, prompts[i]), len(prompts[i]) - 1, lens[-1])
            size = len(groups[-1])
            if shared >= min_shared and size * shared >= (size - 1) * lens[-1]:  # joining saves no less
                groups[-1].append(i)
                lens[-1] = shared
                continue
        groups.append([i])
        lens.append(len(prompts[i]) - 1)
    group, cut = [-1] * len(prompts), [0] * len(prompts)
    kept_lens: list[int] = []
    for members, length in zip(groups, lens, strict=True):
        if len(members) < 2:
            continue
        for i in members:
            group[i], cut[i] = len(kept_lens), length
        kept_lens.append(length)
    return PrefixPlan(group=group, cut=cut, group_len=kept_lens)


def _extend(model: Any, tokens: Sequence[int], c: int, kv: Any, device: str) -> list:
    """Per-layer (keys, values) of `tokens` at batch 1, unpadded: the first `c` positions taken from `kv`, the
    rest computed by one forward (only the last position's logits)."""
    import torch
    from transformers import DynamicCache

    past = DynamicCache(ddp_cache_data=[(k[:, :, :c].clone(), v[:, :, :c].clone()) for k, v in kv]) if c else None
    ids = torch.tensor([list(tokens[c:])], dtype=torch.long, device=device)
    positions = torch.arange(c, len(tokens), dtype=torch.long, device=device)[None]
    kw = {"cache": past} if past is not None else {}
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **kw)
    cache = out["cache"] if "cache" in out else out.past_key_values  # transformers 5 names it `cache`
    return [(layer.keys, layer.values) for layer in cache.layers]


def _head_kv(model: Any, head: Sequence[int], store: Any, device: str) -> tuple[list, int]:
    """(per-layer (keys, values) of `head`, tokens computed): from the store when it holds the whole head, else
    the stored part plus a forward over the rest; the result is stored for later batches."""
    c, kv = store.longest(head, len(head)) if store is not None else (0, None)
    if kv is not None and c == len(head):
        return [(k[:, :, :c], v[:, :, :c]) for k, v in kv], 0
    layers = _extend(model, head, c, kv, device)
    if store is not None:
        store.put(head, layers)
    return layers, len(head) - c


def batched_rest_width(rests: Sequence[int], overhead: int = ROW_OVERHEAD) -> int:
    """The width T of the batched prefill that minimises its padded cost, `len(rests) * T`, plus, for each row
    whose rest is longer, an unpadded batch-1 forward over the excess (`rest - T + overhead` tokens)."""
    best_t, best = max(rests), len(rests) * max(rests)
    for t in sorted(set(rests)):
        cost = len(rests) * t + sum(r - t + overhead for r in rests if r > t)
        if cost < best:
            best_t, best = t, cost
    return best_t


def prefill(model: Any, prompts: Sequence[Sequence[int]], plan: PrefixPlan, pad_id: int, device: str = "cpu",
            store: Any = None, min_shared: int = 16, reserve: int = 64) -> tuple[Any, Any, Any, int]:
    """(input_ids, attention_mask, past_key_values or None, prompt tokens not prefilled again) for `generate`:
    each group's head in the cache, computed once (or taken from `store`, an `openk2.llm.hf_kvstore.PrefixKVStore`,
    which then keeps it); a row in no group takes its longest stored head of at least `min_shared` tokens. The
    cache is an `openk2.llm.hf_cache.growing_cache` with room for `reserve` more tokens."""
    import torch

    from openk2.llm.hf_cache import growing_cache

    cuts, sources, computed = list(plan.cut), [None] * len(prompts), 0
    for g, length in enumerate(plan.group_len):
        members = [i for i, x in enumerate(plan.group) if x == g]
        kv, done = _head_kv(model, prompts[members[0]][:length], store, device)
        computed += done
        for i in members:
            sources[i] = kv
    if store is not None:
        for i, p in enumerate(prompts):
            if plan.group[i] < 0:
                c, kv = store.longest(p, len(p) - 1)  # every row keeps a token of its own for generate
                if c >= max(1, min_shared):
                    cuts[i], sources[i] = c, kv
    # generate prefills every row's rest padded to the longest one; rows far longer than the others get their
    # excess computed alone (unpadded), so one long row does not make the whole batch prefill its length
    target = batched_rest_width([len(p) - c for p, c in zip(prompts, cuts, strict=True)], ROW_OVERHEAD)
    for i, p in enumerate(prompts):
        if len(p) - cuts[i] > target:
            sources[i] = _extend(model, p[:len(p) - target], cuts[i], sources[i], device)
            computed += len(p) - target - cuts[i]
            cuts[i] = len(p) - target
    width = max(cuts, default=0)
    layers = []
    template = next((kv for kv in sources if kv is not None), []) if width else []
    for li, (k0, v0) in enumerate(template):
        keys = k0.new_zeros((len(prompts), k0.shape[1], width, k0.shape[3]))
        values = v0.new_zeros((len(prompts), v0.shape[1], width, v0.shape[3]))
        for i, (kv, c) in enumerate(zip(sources, cuts, strict=True)):
            if kv is not None and c:
                keys[i, :, width - c:] = kv[li][0][0, :, :c]
                values[i, :, width - c:] = kv[li][1][0, :, :c]
        layers.append((keys, values))
    cache = growing_cache(layers, reserve) if layers else None
    rests = [list(p[c:]) for p, c in zip(prompts, cuts, strict=True)]
    rest_width = max(len(r) for r in rests)
    ids, mask = [], []
    for p, c, rest in zip(prompts, cuts, rests, strict=True):
        head = list(p[:c])
        ids.append([pad_id] * (width - c) + head + [pad_id] * (rest_width - len(rest)) + rest)
        mask.append([0] * (width - c) + [1] * c + [0] * (rest_width - len(rest)) + [1] * len(rest))
    return (torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(mask, dtype=torch.long, device=device),
            cache, sum(cuts) - computed)
