"""RL objectives and their companions (report 3.2.2): the K1.5 loss, GRPO for comparison, budget control,
PTX loss and temperature decay. All are pure functions; a trainer picks a loss by name once (`get_loss`).

Shapes: P prompts, K sampled responses per prompt, T response tokens.
- `logp_PK`, `logp_old_PK`: sequence log-probs log pi(y_i|x) (sum over the response tokens).
- `rewards_PK`: one scalar reward per response.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from openk2.model.stats import ForwardStats


def k15_loss(logp: torch.Tensor, logp_old: torch.Tensor, rewards: torch.Tensor, tau: float) -> torch.Tensor:
    """The K1.5/K2 objective, mean over prompts and samples of (r_i - mean_j r_j - tau*log(pi/pi_old))^2.

    The squared residual pulls tau*log(pi/pi_old) towards the centred reward: a regression onto the
    closed-form optimum of KL-regularised policy improvement (Kimi K1.5 paper, "Policy Optimization").
    `logp_old` and the rewards are constants; only `logp` carries gradient. Inputs are [P, K].
    """
    _check_pk(logp, logp_old, rewards)
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    advantage_PK = rewards - rewards.mean(dim=1, keepdim=True)
    log_ratio_PK = logp - logp_old.detach()
    return (advantage_PK.detach() - tau * log_ratio_PK).pow(2).mean()


def grpo_loss(logp: torch.Tensor, logp_old: torch.Tensor, rewards: torch.Tensor, clip_eps: float = 0.2,
              mask: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's clipped surrogate (DeepSeekMath) with group-normalised advantages, for comparison with K1.5.

    `logp`/`logp_old` are [P, K] sequence log-probs or [P, K, T] token log-probs with `mask` [P, K, T]
    (1 on response tokens); token terms are averaged per sequence, then over sequences. No KL-to-reference
    term: like DAPO, the clip alone bounds the step.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, K], got shape {tuple(rewards.shape)}")
    if logp.shape != logp_old.shape or logp.shape[:2] != rewards.shape:
        raise ValueError(f"shape mismatch: logp {tuple(logp.shape)}, logp_old {tuple(logp_old.shape)}, "
                         f"rewards {tuple(rewards.shape)}")
    std_P1 = rewards.std(dim=1, keepdim=True, correction=0)
    advantage_PK = ((rewards - rewards.mean(dim=1, keepdim=True)) / (std_P1 + eps)).detach()
    ratio = torch.exp(logp - logp_old.detach())
    advantage = advantage_PK if logp.dim() == 2 else advantage_PK.unsqueeze(-1)
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantage)
    if logp.dim() == 3:
        if mask is None:
            mask = torch.ones_like(logp)
        mask = mask.to(logp.dtype)
        surrogate = (surrogate * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return -surrogate.mean()


LOSSES: dict[str, Callable[..., torch.Tensor]] = {"k15": k15_loss, "grpo": grpo_loss}


def get_loss(name: str) -> Callable[..., torch.Tensor]:
    """The policy loss called `name` ('k15' or 'grpo'); both take (logp, logp_old, rewards, ...)."""
    if name not in LOSSES:
        raise ValueError(f"unknown RL loss {name!r}; choose one of {', '.join(LOSSES)}")
    return LOSSES[name]


def budget_penalty(rewards: torch.Tensor, num_tokens: torch.Tensor, budget: int | torch.Tensor,
                   penalty: float = 0.5) -> torch.Tensor:
    """Rewards with `penalty` subtracted from every response that used its whole token budget.

    Budget control (report 3.2.2): rollouts sample at most the task's `max_tokens`, so a response that
    reaches it was truncated; penalising it teaches concise answers. `budget` is one int or a per-response
    tensor (a batch mixes tasks with different budgets).
    """
    if penalty < 0:
        raise ValueError(f"budget penalty must be >= 0, got {penalty}")
    over_budget = num_tokens >= torch.as_tensor(budget, device=num_tokens.device)
    return rewards - penalty * over_budget.to(rewards.dtype)


def truncate_to_budget(token_ids: list[int], budget: int) -> tuple[list[int], bool]:
    """`token_ids` cut to `budget` tokens, and whether that cut anything (for engines without max_tokens)."""
    if budget <= 0:
        raise ValueError(f"token budget must be > 0, got {budget}")
    return token_ids[:budget], len(token_ids) > budget


def ptx_loss(model: nn.Module, input_ids: torch.Tensor, weight: float,
             labels: torch.Tensor | None = None, stats: ForwardStats | None = None) -> torch.Tensor:
    """`weight` times the language-model loss on a batch of the curated PTX set (report 3.2.2).

    Mixing this into the RL loss keeps the policy close to high-quality text and counters forgetting.
    `labels` default to `input_ids` (HF convention, shifted inside the model; -100 is ignored). `stats`, an
    `openk2.model.ForwardStats`, records the forward (QK-Clip's max logits) when given.
    """
    extra = {} if stats is None else {"stats": stats}  # any causal LM works when nothing is recorded
    out = model(input_ids, labels=input_ids if labels is None else labels, **extra)
    return weight * out.loss


def decayed_temperature(step: int, start: float, end: float, decay_steps: int, schedule: str = "cosine") -> float:
    """Sampling temperature at `step`: from `start` (explore) to `end` (exploit) over `decay_steps`, then flat.

    Schedules: 'linear', 'cosine' (slow start and finish) and 'exponential' (geometric, needs start, end > 0).
    """
    if start <= 0 or end <= 0:
        raise ValueError(f"temperatures must be > 0, got start={start}, end={end}")
    if decay_steps <= 0:
        raise ValueError(f"decay_steps must be > 0, got {decay_steps}")
    progress = min(max(step, 0), decay_steps) / decay_steps
    if schedule == "linear":
        return start + (end - start) * progress
    if schedule == "cosine":
        return end + (start - end) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "exponential":
        return start * (end / start) ** progress
    raise ValueError(f"unknown temperature schedule {schedule!r}; choose linear, cosine or exponential")


def _check_pk(*tensors: torch.Tensor) -> None:
    shape = tensors[0].shape
    if len(shape) != 2 or any(t.shape != shape for t in tensors):
        raise ValueError(f"expected equal [P, K] tensors, got shapes {[tuple(t.shape) for t in tensors]}")
