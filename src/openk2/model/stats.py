"""ForwardStats: what forward passes saw, recorded by the layers into a collector the caller owns.

Per MoE layer: routed (token, slot) counts per expert (what the aux-loss-free bias update and load logging
read) and the sequence-wise balance loss. Per attention layer, when `track_max_logits` is on: each head's max
scaled, masked pre-softmax logit S_max^h (what QK-Clip reads). Layers given `stats=None` record nothing, so
a forward that should not count (the engine's) simply passes none.

Recording accumulates over calls: counts add, balance losses add, max logits take the max, so one collector
can span the micro-batches of a step. Shape legend: L layers, H heads, E routed experts.
"""

from __future__ import annotations

import copy

import torch

from openk2.config import ModelConfig


class ForwardStats:
    """Caller-owned collector of router statistics, balance losses and (optionally) per-head max logits."""

    def __init__(self, config: ModelConfig, track_max_logits: bool = False) -> None:
        self.track_max_logits = track_max_logits
        self.replay = False  # a recompute replay's throw-away collector (see empty_like)
        self.num_layers, self.num_heads = config.num_hidden_layers, config.num_attention_heads
        self.num_experts = config.n_routed_experts
        self.moe_layer_ids = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
        self._counts: dict[int, torch.Tensor] = {}  # layer -> [E] fp32 (exact for counts below 2^24)
        self._aux: dict[int, torch.Tensor] = {}  # layer -> scalar balance loss
        self._max_logits: dict[int, torch.Tensor] = {}  # layer -> [H] fp32

    # ------------------------------------------------------------------ recording (called by the layers)
    def record_routing(self, layer_idx: int, counts_E: torch.Tensor, aux_loss: torch.Tensor | None = None) -> None:
        """Add one MoE call's tokens per expert [E] and, when computed, its balance loss (graph kept)."""
        counts = counts_E.detach().float()
        prev = self._counts.get(layer_idx)
        self._counts[layer_idx] = counts if prev is None else prev + counts
        if aux_loss is not None:
            prev_aux = self._aux.get(layer_idx)
            self._aux[layer_idx] = aux_loss if prev_aux is None else prev_aux + aux_loss

    @torch.no_grad()
    def record_max_logits(self, layer_idx: int, head_max_H: torch.Tensor) -> None:
        """Max-accumulate one attention call's per-head max logits [H]."""
        head_max = head_max_H.detach().float()
        prev = self._max_logits.get(layer_idx)
        self._max_logits[layer_idx] = head_max if prev is None else torch.maximum(prev, head_max)

    def merge(self, other: ForwardStats) -> None:
        """Fold another collector's records into this one (balance losses detached: gradients flow through the
        forward's own loss, not through a collector that outlives it)."""
        for i, counts in other._counts.items():
            self.record_routing(i, counts, other._aux[i].detach() if i in other._aux else None)
        for i, head_max in other._max_logits.items():
            self.record_max_logits(i, head_max)

    def empty_like(self, replay: bool = False) -> ForwardStats:
        """A new, empty collector with this one's layout and tracking setting; `replay` marks it as the collector
        of a recompute replay (its records are dropped), so layers run the same kernels but need compute no
        probe that would cost extra."""
        other = copy.copy(self)
        other._counts, other._aux, other._max_logits = {}, {}, {}
        other.replay = replay
        return other

    def reset(self) -> None:
        """Forget everything recorded (the tracking setting stays)."""
        self._counts.clear()
        self._aux.clear()
        self._max_logits.clear()

    # ------------------------------------------------------------------ reading
    def tokens_per_expert(self) -> torch.Tensor | None:
        """[num_moe_layers, E] fp32 routed counts, zero rows for MoE layers that did not run (other pipeline
        stages); None for a model without MoE layers."""
        if not self.moe_layer_ids:
            return None
        like = next(iter(self._counts.values()), None)
        zeros = torch.zeros(self.num_experts) if like is None else torch.zeros_like(like)
        return torch.stack([self._counts.get(i, zeros) for i in self.moe_layer_ids])

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the recorded balance losses over MoE layers (in layer order), or None if none was computed."""
        aux = [self._aux[i] for i in sorted(self._aux)]
        return torch.stack(aux).sum() if aux else None

    def max_logits(self) -> torch.Tensor:
        """[L, H] fp32 (CPU) per-head max logits, -inf for layers that recorded none (tracking off, other
        pipeline stages: a cross-rank MAX fills those)."""
        out = torch.full((self.num_layers, self.num_heads), float("-inf"))
        for i, head_max in self._max_logits.items():
            out[i] = head_max.cpu()
        return out
