"""Sampling parameters and the batched next-token sampler (temperature, top-k, top-p, per-sequence seeds).

Every sequence draws its randomness from its own torch.Generator, so a seeded request gives the same tokens
whatever else shares its batch. A sample is argmax(p / e) with e ~ Exp(1) i.i.d. per vocabulary entry (the
"exponential race", equivalent to drawing from p); greedy rows (temperature 0) take argmax(logits) and draw
nothing. Log-probs are always those of the raw model distribution: log_softmax(logits) at temperature 1, before
any filtering, which is what RL objectives (importance ratios, KL) need.

Constrained decoding: `SamplingParams.constraint` is a factory of per-sample `Constraint` states (a grammar
matcher); before each draw the engine asks the state which tokens are allowed, masks the others to -inf (for the
draw only: log-probs stay those of the raw distribution), and tells it the token drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, sample) pairs over the 63-bit seed space


class Constraint(Protocol):
    """One sample's grammar state: which tokens may come next, and what was drawn."""

    def allowed(self) -> torch.Tensor | None:
        """Bool [vocab] mask of the tokens allowed next (None: any token)."""

    def advance(self, token: int) -> None:
        """Accept the token drawn (always one `allowed` permitted)."""

    def is_terminated(self) -> bool:
        """True once the grammar is complete: the sample then ends with finish_reason "stop"."""


@dataclass
class SamplingParams:
    """How to sample one request (all of its n samples)."""

    max_tokens: int = 16  # new tokens per sample; reaching it ends the sample with finish_reason "length"
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of top tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 (or negative) turns it off
    seed: int | None = None  # per request; sample i of the request uses a generator derived from (seed, i)
    n: int = 1  # samples per prompt
    stop_token_ids: Sequence[int] = field(default_factory=tuple)  # included in the output when hit
    stop: Sequence[str] = field(default_factory=tuple)  # stop strings (need a tokenizer); cut from `text`
    ignore_eos: bool = False  # otherwise the tokenizer's eos_id (or the config's eos_token_id) also stops
    return_logits: bool = False  # keep each step's fp32 logits [V] (tests, debugging; memory-hungry)
    constraint: Callable[[], Constraint] | None = None  # builds each sample's grammar state (constrained decoding)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.stop = tuple(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None, sample_index: int, device: str | torch.device) -> torch.Generator:
    """The generator of sample `sample_index` of a request: derived from `seed`, or from torch's global RNG."""
    if seed is None:
        base = int(torch.randint(0, 2**62, (1,)).item())  # reproducible under torch.manual_seed
    else:
        base = (int(seed) * _SEED_MIX + sample_index) % (2**63 - 1)
    return torch.Generator(device=device).manual_seed(base)


def filter_top_k_top_p(logits_BV: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """Logits with everything outside each row's top-k, then outside its top-p nucleus, set to -inf.

    top_k_B [B] long (<= 0: off), top_p_B [B] float (1: off). Top-p is taken over the top-k-renormalised
    distribution; the most likely token is always kept.
    """
    v = logits_BV.shape[-1]
    sorted_logits, order = logits_BV.sort(dim=-1, descending=True)
    ranks = torch.arange(v, device=logits_BV.device)
    k = torch.where(top_k_B > 0, top_k_B.clamp(max=v), torch.full_like(top_k_B, v))
    remove = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
    remove |= mass_before >= top_p_B[:, None]
    remove[:, 0] = False
    filtered = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits_BV, float("-inf")).scatter(1, order, filtered)


def sample_tokens(
    logits_BV: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    masks: Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] and their log-probs [B] under log_softmax(logits) (temperature 1, unfiltered).

    `params[b]` and `generators[b]` belong to row b (a greedy row's generator is not used); `masks[b]`, a bool
    [V] of allowed tokens or None, restricts row b's draw (its log-prob is still the unmasked one).
    """
    logprobs_BV = logits_BV.float().log_softmax(dim=-1)
    logits = logits_BV.float()
    if masks is not None and any(m is not None for m in masks):
        logits = logits.clone()
        for b, m in enumerate(masks):
            if m is not None:
                logits[b].masked_fill_(~m.to(logits.device), float("-inf"))
    tokens = logits.argmax(dim=-1)
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    if sampled:
        dev = logits.device
        rows = torch.tensor(sampled, device=dev)
        temps = torch.tensor([params[b].temperature for b in sampled], device=dev)
        scaled = logits[rows] / temps[:, None]
        top_k = torch.tensor([params[b].top_k for b in sampled], device=dev, dtype=torch.long)
        top_p = torch.tensor([params[b].top_p for b in sampled], device=dev, dtype=torch.float32)
        if any(params[b].top_k > 0 or params[b].top_p < 1 for b in sampled):
            scaled = filter_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        race = torch.stack([torch.empty_like(probs[0]).exponential_(generator=generators[b]) for b in sampled])
        tokens = tokens.index_copy(0, rows, (probs / race).argmax(dim=-1))
    return tokens, logprobs_BV.gather(1, tokens[:, None]).squeeze(1)
