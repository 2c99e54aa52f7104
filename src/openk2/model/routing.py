"""RoutingTrace: a caller-owned record of the experts each MoE layer chose in one forward, and the means to
replay given experts in a later forward (rollout routing replay, "R3").

Why: in MoE RL the rollout engine and the training forward run the same weights with different kernels,
batch shapes or precision, so a token near a routing tie can go to different experts in the two, and the
log-ratio log pi_train - log pi_rollout then measures the router's flip, not the policy. R3 (Ma et al. 2025,
"Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers") records the experts the
rollout chose for each token and makes the training forward use them; the gate weights are still computed
from the training router's own scores at those experts, so the router keeps receiving gradients.

Use: pass `routing=RoutingTrace(config)` to a forward to record; `RoutingTrace(config, replay=...)` to
replay. `replay` is [N, L, K] or [B, T, L, K] expert ids (L = MoE layers in layer order, K experts per
token, tokens flattened as the MoE layers flatten them, row-major over B, T); a token whose row holds any -1
in a layer routes by itself there. Each MoE layer records the experts it used and the router's own choice
(equal unless replayed), overwriting what an earlier call of the same layer wrote, so a recompute's second
call of a layer records the same thing again. A forward given no trace (`routing=None`) costs nothing extra.

Shape legend: N tokens (B*T), L MoE layers, K experts per token, E routed experts.
"""

from __future__ import annotations

import torch

from openk2.config import ModelConfig

FREE = -1  # a replay entry meaning "let the router choose"


class RoutingTrace:
    """Caller-owned routing record (experts used and experts the router would choose) and optional replay."""

    def __init__(self, config: ModelConfig, replay: torch.Tensor | None = None) -> None:
        self.moe_layer_ids = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
        self._slot = {layer: s for s, layer in enumerate(self.moe_layer_ids)}
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.replay_NLK = None
        if replay is not None:
            if replay.dim() == 4:
                replay = replay.reshape(-1, *replay.shape[2:])
            if replay.dim() != 3 or tuple(replay.shape[1:]) != (len(self.moe_layer_ids), self.top_k):
                raise ValueError(f"replay must be [N, {len(self.moe_layer_ids)}, {self.top_k}] or "
                                 f"[B, T, {len(self.moe_layer_ids)}, {self.top_k}], got {tuple(replay.shape)}")
            if replay.numel() and (int(replay.max()) >= self.num_experts or int(replay.min()) < FREE):
                raise ValueError(f"replayed expert ids must lie in [0, {self.num_experts}) or be {FREE}")
            self.replay_NLK = replay.long()
        self._used: dict[int, torch.Tensor] = {}  # layer -> [N, K] experts the layer ran
        self._chosen: dict[int, torch.Tensor] = {}  # layer -> [N, K] the router's own top-k

    # ------------------------------------------------------------------ called by the MoE layers
    def replay_for(self, layer_idx: int, num_tokens: int, device: torch.device) -> torch.Tensor | None:
        """[N, K] experts to replay at `layer_idx` (FREE rows route freely), or None when not replaying."""
        if self.replay_NLK is None:
            return None
        if self.replay_NLK.shape[0] != num_tokens:
            raise ValueError(f"replay covers {self.replay_NLK.shape[0]} tokens, the forward has {num_tokens}")
        return self.replay_NLK[:, self._slot[layer_idx]].to(device)

    def record(self, layer_idx: int, used_NK: torch.Tensor, chosen_NK: torch.Tensor) -> None:
        """Keep one MoE call's experts used and the router's own choice (replacing an earlier call's)."""
        self._used[layer_idx] = used_NK.detach()
        self._chosen[layer_idx] = chosen_NK.detach()

    # ------------------------------------------------------------------ reading
    def used(self) -> torch.Tensor:
        """[N, L, K] int64 experts every MoE layer ran for each token (replayed ones where replayed)."""
        return self._stack(self._used)

    def chosen(self) -> torch.Tensor:
        """[N, L, K] int64 experts each MoE layer's router picked by itself (== used() without replay)."""
        return self._stack(self._chosen)

    def _stack(self, per_layer: dict[int, torch.Tensor]) -> torch.Tensor:
        if not self.moe_layer_ids:
            raise ValueError("the model has no MoE layers: there is no routing to read")
        missing = [i for i in self.moe_layer_ids if i not in per_layer]
        if missing:
            raise ValueError(f"MoE layers {missing} recorded no routing (did the forward get this trace?)")
        return torch.stack([per_layer[i] for i in self.moe_layer_ids], dim=1)


def routing_agreement(a_NLK: torch.Tensor, b_NLK: torch.Tensor, valid_N: torch.Tensor | None = None) -> float:
    """Fraction of (token, layer) expert choices in `a` that `b` also made (order within a token's K ignored),
    over the tokens where `valid_N` is true; nan when no token counts.

    >>> a = torch.tensor([[[0, 1]], [[2, 3]]])
    >>> routing_agreement(a, torch.tensor([[[1, 0]], [[2, 4]]]))
    0.75
    """
    if a_NLK.shape != b_NLK.shape:
        raise ValueError(f"routings differ in shape: {tuple(a_NLK.shape)} vs {tuple(b_NLK.shape)}")
    if valid_N is not None:
        a_NLK, b_NLK = a_NLK[valid_N], b_NLK[valid_N]
    if a_NLK.numel() == 0:
        return float("nan")
    hit = (a_NLK[..., :, None] == b_NLK[..., None, :]).any(-1)
    return float(hit.float().mean())
