"""Batched generation for K2ForCausalLM over a latent KV cache, with MLA's absorbed-projection decode.

Prefill runs the whole prompt in MLA's expanded form (per-head keys and values from kv_b_proj, as training
does); decode runs the absorbed form, which never expands the cache:

    scores_h[j] = ((q^C_h W_UK_h) . c_j + q^R_h . k^R_j) * scale        W_UK_h: kv_b_proj's k^C rows [N, C]
    out_h       = W_UV_h (sum_j softmax(scores_h)[j] c_j)                W_UV_h: kv_b_proj's v rows   [V, C]
    out         = o_proj(concat_h out_h)

so one decode step reads C + R numbers per cached token and per layer, shared by all heads, instead of
H * (N + R + V). The forward is the model's own (K2Model and its DecoderLayers): the engine only passes in a
`LatentCacheAttention` (openk2.infer.latent_attention) as the layers' attention core, and no statistics collector,
so MoE load counts and max logits a trainer collects never see inference.

Scheduling (`step`): every running sequence decodes one token; then waiting sequences are admitted into free
cache slots and prefilled together, which gives them their first token (right-padded: a sequence's tokens sit at
positions 0..len-1 of its slot, padding only ever follows its real tokens, so the causal mask keeps it out of
every real token's attention and nothing real changes). The n samples of one request share one prefill (its
latents are copied to the siblings' slots). So each step adds exactly one token to every unfinished sample.
Finished sequences free their slot at once and new requests join mid-flight (continuous batching). `generate`
is add_request for each prompt, then step until done.

Shape legend: B batch, T new tokens, S cached positions, H heads, D hidden, C kv_lora_rank, N qk_nope_head_dim,
R qk_rope_head_dim, V v_head_dim (or vocab for logits).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from openk2.infer.kv_cache import LatentKVCache
from openk2.infer.latent_attention import LatentCacheAttention, absorbed_attention, expanded_attention
from openk2.infer.sampling import SamplingParams, make_generator, sample_tokens

_UTF8_SLACK = 4  # characters re-scanned for stop strings beyond the longest stop string

__all__ = [
    "Engine",
    "GenerationResult",
    "LatentKVCache",
    "SamplingParams",
    "absorbed_attention",
    "expanded_attention",
]


# ---------------------------------------------------------------------- results and sequences
@dataclass
class GenerationResult:
    """One finished sample. token_ids/logprobs cover the generated tokens only (stop token included)."""

    request_id: int | str
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log p(token) under the temperature-1, unfiltered model distribution
    finish_reason: str  # "stop" (stop token / stop string / eos) or "length" (max_tokens)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    text: str | None = None  # decoded tokens when the engine has a tokenizer, cut before a matched stop string
    logits: torch.Tensor | None = None  # [len(token_ids), vocab] fp32 when params.return_logits


@dataclass
class _Sequence:
    request_id: int | str
    sample_index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    slot: int | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    stop_scan_from: int = 0  # text offset before which no stop string can start any more

    def result(self, reason: str, stop_reason, text: str | None) -> GenerationResult:
        logits = torch.stack(self.logits) if self.logits else None
        return GenerationResult(self.request_id, self.sample_index, self.prompt, self.tokens, self.logprobs,
                                reason, stop_reason, text, logits)


# ---------------------------------------------------------------------- engine
class Engine:
    """Batched, incremental generation for a K2ForCausalLM (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        max_batch_size: int = 8,
        max_seq_len: int = 2048,
        max_prefill_tokens: int = 8192,
        absorbed: bool = True,
    ) -> None:
        """`tokenizer` (an openk2 K2Tokenizer, or anything with decode and eos_id) enables stop strings and
        `text`; max_batch_size sequences (samples) run at once, each at most max_seq_len tokens (prompt +
        generated); a prefill batch holds at most max_prefill_tokens padded tokens (at least one prompt);
        `absorbed=False` decodes with the expanded form instead (for checks)."""
        self.model = model
        self.cfg = model.config
        self.tokenizer = tokenizer
        self.eos_id = getattr(tokenizer, "eos_id", None) if tokenizer is not None else self.cfg.eos_token_id
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.absorbed = absorbed
        weight = model.model.embed_tokens.weight
        self.device = weight.device
        self.cache = LatentKVCache(self.cfg, max_batch_size, max_seq_len, dtype=weight.dtype, device=weight.device)
        self._waiting: deque[_Sequence] = deque()
        self._running: dict[int, _Sequence] = {}  # slot -> sequence; its last token is sampled, not yet cached
        self._free_slots = list(range(max_batch_size))
        self._next_request_id = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None,
                    request_id: int | str | None = None) -> int | str:
        """Queue params.n samples of `prompt`; returns the request id the results carry."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompts must hold at least one token")
        if len(prompt) + params.max_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_seq_len={self.max_seq_len}")
        vocab = self.cfg.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need an Engine with a tokenizer")
        active = {s.request_id for s in self._waiting} | {s.request_id for s in self._running.values()}
        if request_id is None:
            while self._next_request_id in active:
                self._next_request_id += 1
            request_id = self._next_request_id
            self._next_request_id += 1
        elif request_id in active:
            raise ValueError(f"request id {request_id!r} is already in use")
        for i in range(params.n):
            gen = None if params.greedy else make_generator(params.seed, i, self.device)
            self._waiting.append(_Sequence(request_id, i, prompt, params, gen))
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def running_progress(self) -> list[tuple[int | str, int, list[int], list[float]]]:
        """(request_id, sample_index, tokens so far, their log-probs) of every running sample, for streaming."""
        return [(s.request_id, s.sample_index, s.tokens, s.logprobs) for s in self._running.values()]

    def abort(self, request_id: int | str) -> None:
        """Drop a request's waiting and running samples (no results are produced for them)."""
        self._waiting = deque(s for s in self._waiting if s.request_id != request_id)
        for slot, seq in list(self._running.items()):
            if seq.request_id == request_id:
                self._release(slot)

    def step(self) -> list[GenerationResult]:
        """One new token for every unfinished sample: decode one token for each running sequence, and prefill
        waiting ones into free slots (their first token). Returns the samples that finished in this step."""
        finished: list[GenerationResult] = []
        with self._inference_mode():
            if self._running:
                finished += self._decode_step()
            if self._waiting and self._free_slots:
                finished += self._prefill_step()
        return finished

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """Generate for every prompt; returns len(prompts) * n results, prompt by prompt, then sample by sample.
        `params` is one SamplingParams for all prompts or one per prompt. The engine must be idle."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine (requests added with add_request are pending)")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        order = {}
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            order[self.add_request(prompt, p, request_id=f"generate-{i}")] = i
        results: list[GenerationResult] = []
        while self.has_unfinished():
            results += self.step()
        results.sort(key=lambda r: (order[r.request_id], r.sample_index))
        for r in results:
            r.request_id = order[r.request_id]
        return results

    # ------------------------------------------------------------------ scheduling
    def _prefill_step(self) -> list[GenerationResult]:
        admitted: list[_Sequence] = []
        leaders: dict[int | str, _Sequence] = {}
        longest = 0
        while self._waiting and self._free_slots:
            seq = self._waiting[0]
            new_leader = seq.request_id not in leaders
            if new_leader and leaders:
                padded = (len(leaders) + 1) * max(longest, len(seq.prompt))
                if padded > self.max_prefill_tokens:
                    break
            self._waiting.popleft()
            seq.slot = heapq.heappop(self._free_slots)
            admitted.append(seq)
            if new_leader:
                leaders[seq.request_id] = seq
                longest = max(longest, len(seq.prompt))
        heads = list(leaders.values())
        ids = torch.zeros(len(heads), longest, dtype=torch.long)
        for b, seq in enumerate(heads):
            ids[b, : len(seq.prompt)] = torch.tensor(seq.prompt)
        logits = self._forward(ids.to(self.device), [s.slot for s in heads], [len(s.prompt) for s in heads],
                               absorbed=False)
        row_of = {s.request_id: b for b, s in enumerate(heads)}
        for seq in admitted:
            lead = leaders[seq.request_id]
            if seq is not lead:
                self.cache.copy_slot(lead.slot, seq.slot, len(seq.prompt))
            self._running[seq.slot] = seq
        rows = torch.tensor([row_of[s.request_id] for s in admitted], device=self.device)
        return self._sample_and_check(admitted, logits[rows])

    def _decode_step(self) -> list[GenerationResult]:
        slots = sorted(self._running)
        seqs = [self._running[s] for s in slots]
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device)
        logits = self._forward(ids, slots, [1] * len(slots), absorbed=self.absorbed)
        return self._sample_and_check(seqs, logits)

    def _sample_and_check(self, seqs: list[_Sequence], logits_BV: torch.Tensor) -> list[GenerationResult]:
        tokens, logprobs = sample_tokens(logits_BV, [s.params for s in seqs], [s.generator for s in seqs])
        finished = []
        for b, (seq, token, logprob) in enumerate(zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True)):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            if seq.params.return_logits:
                seq.logits.append(logits_BV[b].float().cpu())
            done = self._check_stop(seq, token)
            if done is not None:
                finished.append(seq.result(*done))
                self._release(seq.slot)
        return finished

    def _check_stop(self, seq: _Sequence, token: int) -> tuple[str, int | str | None, str | None] | None:
        """(finish_reason, stop_reason, text) if `seq` has just finished, else None."""
        p = seq.params
        text = self.tokenizer.decode(seq.tokens) if p.stop else None  # add_request made sure of a tokenizer
        if token in p.stop_token_ids or (not p.ignore_eos and self.eos_id is not None and token == self.eos_id):
            return "stop", token, self._text(seq, text)
        if p.stop:
            hit = _find_stop(text, p.stop, seq.stop_scan_from)
            if hit is not None:
                start, stop = hit
                return "stop", stop, text[:start]
            # A match must end in text the newest token changed; the slack covers bytes of a split UTF-8
            # character (decoded as replacement characters) that merge into one once it completes.
            seq.stop_scan_from = max(0, len(text) - max(len(s) for s in p.stop) - _UTF8_SLACK)
        if len(seq.tokens) >= p.max_tokens:
            return "length", None, self._text(seq, text)
        return None

    def _text(self, seq: _Sequence, text: str | None) -> str | None:
        if self.tokenizer is None:
            return None
        return text if text is not None else self.tokenizer.decode(seq.tokens)

    def _release(self, slot: int) -> None:
        del self._running[slot]
        self.cache.free(slot)
        heapq.heappush(self._free_slots, slot)

    @contextmanager
    def _inference_mode(self):
        # No autograd and eval mode (no MoE aux loss); statistics live in callers' collectors, which the engine
        # never receives, so there is nothing else to save and restore.
        model = self.model
        was_training = model.training
        if was_training:
            model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            if was_training:
                model.train()

    # ------------------------------------------------------------------ the forward pass
    def _forward(self, ids_BT: torch.Tensor, slots: list[int], lens: list[int], absorbed: bool) -> torch.Tensor:
        """Append lens[b] tokens ids_BT[b, :lens[b]] (right-padded) to cache slot slots[b], run the model over
        them and return fp32 logits [B, vocab] at each row's last new token. Updates the slots' lengths."""
        b, t = ids_BT.shape
        dev = ids_BT.device
        starts = [self.cache.lengths[s] for s in slots]
        totals = [s + n for s, n in zip(starts, lens, strict=True)]
        if max(totals) > self.max_seq_len:
            raise IndexError(f"sequence would reach {max(totals)} tokens > max_seq_len={self.max_seq_len}")
        s_len = max(totals)
        offsets = torch.arange(t, device=dev)
        starts_B = torch.tensor(starts, device=dev)
        positions_BT = starts_B[:, None] + offsets
        valid_BT = offsets[None, :] < torch.tensor(lens, device=dev)[:, None]
        if all(n == s_len for n in totals) or (max(starts) == 0 and t == s_len):
            # Equal lengths, or a fresh right-padded prefill (padding follows every real token): plain causal.
            mask_B1TS = None
        else:
            # Key j is visible to new token i of row b iff j <= its position and j < the row's new length.
            key_pos = torch.arange(s_len, device=dev)
            mask = (key_pos <= positions_BT[..., None]) & (key_pos < torch.tensor(totals, device=dev)[:, None, None])
            mask_B1TS = mask[:, None]
        slots_B = torch.tensor(slots, device=dev)
        all_valid = all(n == t for n in lens)
        write_slots = slots_B[:, None].expand(b, t) if all_valid else slots_B[:, None].expand(b, t)[valid_BT]
        write_pos = positions_BT if all_valid else positions_BT[valid_BT]
        read_slots = slice(0, b) if slots == list(range(b)) else slots_B
        attention = LatentCacheAttention(self.cache, write_slots, write_pos, None if all_valid else valid_BT,
                                         read_slots, s_len, mask_B1TS, absorbed)
        hidden_BTD = self.model.model(ids_BT, positions_BT, inner_attention=attention)
        for slot, total in zip(slots, totals, strict=True):
            self.cache.lengths[slot] = total
        last = torch.tensor(lens, device=dev) - 1
        return self.model.lm_head(hidden_BTD[torch.arange(b, device=dev), last]).float()


def _find_stop(text: str, stops: Sequence[str], scan_from: int) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in text[scan_from:], or None."""
    best = None
    for stop in stops:
        i = text.find(stop, scan_from)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best
