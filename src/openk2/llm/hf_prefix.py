"""Shared-prefix prefill for a batched `generate`: prompts that start alike are prefilled once per group.

Concurrent synthesis calls repeat long prompt heads (one agent's system prompt and tool list in every episode of
its tasks, one judge instruction per task), and on a CPU prefill costs about as much per token as decoding. So
`plan_prefixes` groups a batch's prompts by common prefix (sorted, adjacent prompts sharing at least
`min_shared` tokens), `prefill` runs each group's prefix once (left-padded to the longest prefix) and copies its
KV rows to the group's members, and `generate` gets the full layout

    [pad .. group prefix][pad .. rest of the prompt]   with attention 0 on every pad

plus that cache, so it only prefills the rests. Positions come from the attention mask (cumsum - 1), as
transformers computes them for left padding, so a row sees the same positions and keys as its unshared prompt:
greedy outputs equal the plain batch's (tested). A prompt in no group has an empty prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


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


def prefill(model: Any, prompts: Sequence[Sequence[int]], plan: PrefixPlan, pad_id: int,
            device: str = "cpu") -> tuple[Any, Any, Any]:
    """(input_ids, attention_mask, past_key_values) for `generate`, the group prefixes already in the cache."""
    import torch

    width = max(plan.group_len)
    heads = []
    for g, length in enumerate(plan.group_len):
        row = plan.group.index(g)
        heads.append(list(prompts[row][:length]))
    head_ids = torch.tensor([[pad_id] * (width - len(h)) + h for h in heads], dtype=torch.long, device=device)
    head_mask = torch.tensor([[0] * (width - len(h)) + [1] * len(h) for h in heads], dtype=torch.long,
                             device=device)
    positions = (head_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=head_ids, attention_mask=head_mask, position_ids=positions, use_cache=True)
    cache = out["cache"] if "cache" in out else out.past_key_values  # transformers 5 names it `cache`
    cache.batch_select_indices(torch.tensor([max(g, 0) for g in plan.group], dtype=torch.long, device=device))
    rests = [list(p[c:]) for p, c in zip(prompts, plan.cut, strict=True)]
    rest_width = max(len(r) for r in rests)
    ids, mask = [], []
    for p, c, rest in zip(prompts, plan.cut, rests, strict=True):
        head = list(p[:c])
        ids.append([pad_id] * (width - c) + head + [pad_id] * (rest_width - len(rest)) + rest)
        mask.append([0] * (width - c) + [1] * c + [0] * (rest_width - len(rest)) + [1] * len(rest))
    return (torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(mask, dtype=torch.long, device=device),
            cache)
