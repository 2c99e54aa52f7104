"""Batched generation for K2ForCausalLM over a paged latent KV cache, with MLA's absorbed-projection decode.

Prefill runs prompt tokens in MLA's expanded form (per-head keys and values from kv_b_proj, as training does);
decode runs the absorbed form, which never expands the cache:

    scores_h[j] = ((q^C_h W_UK_h) . c_j + q^R_h . k^R_j) * scale        W_UK_h: kv_b_proj's k^C rows [N, C]
    out_h       = W_UV_h (sum_j softmax(scores_h)[j] c_j)                W_UV_h: kv_b_proj's v rows   [V, C]
    out         = o_proj(concat_h out_h)

so one decode step reads C + R numbers per cached token and per layer, shared by all heads, instead of
H * (N + R + V). The forward is the model's own (K2Model and its DecoderLayers): the engine only passes in a
`LatentCacheAttention` (openk2.infer.latent_attention) as the layers' attention core, and no statistics collector,
so MoE load counts and max logits a trainer collects never see inference. One-token absorbed decode steps of a plain
(unwrapped, unhooked) model run the same arithmetic in fewer eager ops (openk2.infer.decode_step, bit-identical;
`fast_decode=False` turns it off); `decode_compile=True` runs them as one torch.compile graph per batch bucket instead
(openk2.infer.compiled_decode: greedy-identical, logits within float rounding).

Memory (openk2.infer.kv_cache): a sequence holds a block table into a `PagedLatentCache`; full blocks are named by
a hash chained over their tokens, so a prompt that starts like an earlier one (a shared system prompt or tool
list, the previous turn of a conversation, a sibling sample) reuses those blocks and computes only the rest.

Scheduling (`step`): every decoding sequence decodes one token; then prefill runs at most `max_prefill_tokens`
(padded) prompt tokens: first the next chunk of prompts already being prefilled, then waiting sequences admitted
while the batch has room (`max_batch_size` sequences) and the cache has blocks for their worst case (prompt +
max_tokens, so nothing admitted ever runs out of memory). A prompt longer than the budget is prefilled in chunks
over several steps (chunked prefill) while the others keep decoding; its last chunk gives its first token. Prefill
rows are right-padded and may start at any cached position (an explicit mask then keeps every real token's view
exact). The n samples of one request share one prefill: siblings take the leader's full blocks and a copy of its
partial one. Finished sequences release their blocks at once and new requests join mid-flight (continuous
batching). `generate` is add_request for each prompt, then step until done.

Shape legend: B batch, T new tokens, S cached positions, H heads, D hidden, C kv_lora_rank, N qk_nope_head_dim,
R qk_rope_head_dim, V v_head_dim (or vocab for logits).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from openk2.infer import decode_step
from openk2.infer.compiled_decode import CompiledDecode
from openk2.infer.kv_cache import ROOT_HASH, PagedLatentCache, block_hash, prefix_hashes
from openk2.infer.latent_attention import LatentCacheAttention, absorbed_attention, expanded_attention
from openk2.infer.sampling import SamplingParams, make_generator, sample_tokens
from openk2.model.compile import compile_blocks
from openk2.model.routing import RoutingTrace

_UTF8_SLACK = 4  # characters re-scanned for stop strings beyond the longest stop string

__all__ = [
    "Engine",
    "GenerationResult",
    "PagedLatentCache",
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
    # [len(prompt_token_ids) + len(token_ids) - 1, MoE layers, K] int16 when the engine records routing: row p holds
    # the experts each MoE layer ran for the input at position p of prompt + tokens (the last token is never fed);
    # -1 rows: positions served from the prefix cache (computed for an earlier request)
    routing: torch.Tensor | None = None


@dataclass
class _Sequence:
    request_id: int | str
    sample_index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    constraint: Any = None  # per-sample grammar state from params.constraint (see sampling.Constraint)
    blocks: list[int] = field(default_factory=list)  # block table into the cache
    cached: int = 0  # tokens whose latents are in the cache (positions 0..cached-1)
    hashes: list[bytes] = field(default_factory=list)  # prefix names of its leading full blocks, in order
    shareable: bool = True  # False once the weights changed under it: its blocks are never named again
    reserve: int = 0  # blocks the sequence may need at most (prompt + max_tokens)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    routing: list[torch.Tensor] = field(default_factory=list)  # [n, L, K] int16 chunks, positions 0..cached-1
    stop_scan_from: int = 0  # text offset before which no stop string can start any more

    @property
    def prefill_target(self) -> int:
        # Positions to compute before decoding: the prompt, and after a preemption every generated token but
        # the last (the next decode step feeds that one).
        return len(self.prompt) + max(len(self.tokens) - 1, 0)

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prefill_target

    def token_at(self, i: int) -> int:
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.tokens[i - n]

    def result(self, reason: str, stop_reason, text: str | None) -> GenerationResult:
        logits = torch.stack(self.logits) if self.logits else None
        routing = torch.cat(self.routing) if self.routing else None
        return GenerationResult(self.request_id, self.sample_index, self.prompt, self.tokens, self.logprobs,
                                reason, stop_reason, text, logits, routing)


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
        block_size: int = 16,
        num_blocks: int | None = None,
        prefix_caching: bool = True,
        record_routing: bool = False,
        compile: bool = False,
        preemption: bool = True,
        fast_decode: bool = True,
        decode_compile: bool | str = False,
    ) -> None:
        """`tokenizer` (an openk2 K2Tokenizer, or anything with decode and eos_id) enables stop strings and
        `text`; max_batch_size sequences (samples) run at once, each at most max_seq_len tokens (prompt +
        generated); one step prefills at most max_prefill_tokens padded tokens (longer prompts in chunks);
        the cache holds num_blocks blocks of block_size tokens (default: max_batch_size full-length sequences);
        `prefix_caching` shares the blocks of equal prompt prefixes; `absorbed=False` decodes with the expanded
        form instead (for checks). `record_routing` gives every result the experts of every position it ran
        (GenerationResult.routing, for R3 replay in training: a RoutingTrace per forward, none when off);
        positions a prefix-cache hit skipped are -1 there (a cached block keeps no routing), while the n samples
        of one request share the leader's. `compile` torch.compiles the model's decoder blocks in place
        (model/compile.py, dynamic shapes: batch and chunk sizes vary step to step). `preemption` admits a
        sequence when the cache holds its prompt and first token, and when decoding runs out of blocks preempts
        the most recently admitted sequences (recompute, as vLLM: see `_make_room`); without it a sequence is
        admitted only when its worst case (prompt + max_tokens) is free, and nothing is ever preempted.
        `fast_decode` runs absorbed one-token decode steps through infer/decode_step.py (the same arithmetic in
        fewer eager ops) whenever the model is the plain, unwrapped K2 layout; off, or for any other model, every
        step runs the model's own modules. `decode_compile` runs those fused steps (when routing is not recorded)
        as one torch.compile graph per batch bucket (1, 2, 4, 8, ...; infer/compiled_decode.py): each bucket's
        first step compiles (tens of seconds; `decode_compile_seconds`), and one cache block is held back as
        the padding rows' scratch space (fp32 models only); a string names the torch.compile backend (True:
        "inductor"; "none": the static graph uncompiled)."""
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if compile and decode_compile:
            raise ValueError("compile and decode_compile are exclusive (compiled blocks already run every step)")
        if compile:
            compile_blocks(model)
        self.model = model
        self.cfg = model.config
        self.tokenizer = tokenizer
        self.eos_id = getattr(tokenizer, "eos_id", None) if tokenizer is not None else self.cfg.eos_token_id
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.absorbed = absorbed
        self._moe_layers = sum(map(self.cfg.is_moe_layer, range(self.cfg.num_hidden_layers)))
        self.record_routing = record_routing and self._moe_layers > 0  # a dense model has no routing
        self.prefix_caching = prefix_caching
        weight = model.model.embed_tokens.weight
        self.device = weight.device
        if num_blocks is None:
            num_blocks = max_batch_size * -(-max_seq_len // block_size) + bool(decode_compile)
        self.cache = PagedLatentCache(self.cfg, num_blocks, block_size, dtype=weight.dtype, device=weight.device)
        if self.cache.blocks_for(max_seq_len) > num_blocks:
            raise ValueError(f"num_blocks={num_blocks} cannot hold one sequence of max_seq_len={max_seq_len}")
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # admitted: prefilling (no token yet) or decoding, in admission order
        self._next_request_id = 0
        # Modules are fixed for the engine's lifetime; their _parameters/_buffers dicts are read every step.
        self._weight_dicts = [d for m in model.modules() for d in (m._parameters, m._buffers)]
        self._weights_seen = self._weights_version()
        self.fast_decode = fast_decode and not compile and decode_step.supports(model)
        self._layout: list = []  # (module __dict__, its _modules, their values) at the last layout check
        self._layout_seen: tuple[int, bool] | None = None
        self._layout_ok = False
        self._compiled = None
        if decode_compile:
            if not self.fast_decode:
                raise ValueError("decode_compile needs fast_decode and a plain K2 model (no hooks or wrappers)")
            self._compiled = CompiledDecode(model, "inductor" if decode_compile is True else str(decode_compile))
            self._scratch_row = self.cache.allocate() * block_size  # padding rows write here; never released
        self.prefill_tokens_computed = 0  # prompt tokens run through the model (prefix hits excluded)
        self.preemption = preemption
        self.preemptions = 0  # sequences preempted so far (a counter for tests and benchmarks)

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
        active = {s.request_id for s in self._waiting} | {s.request_id for s in self._running}
        if request_id is None:
            while self._next_request_id in active:
                self._next_request_id += 1
            request_id = self._next_request_id
            self._next_request_id += 1
        elif request_id in active:
            raise ValueError(f"request id {request_id!r} is already in use")
        # Constraint states are built before anything is queued, so a bad grammar rejects the whole request.
        constraints = [params.constraint() if params.constraint is not None else None for _ in range(params.n)]
        reserve = self.cache.blocks_for(len(prompt) + params.max_tokens)
        for i in range(params.n):
            gen = None if params.greedy else make_generator(params.seed, i, self.device)
            self._waiting.append(_Sequence(request_id, i, prompt, params, gen, constraints[i], reserve=reserve))
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def running_progress(self) -> list[tuple[int | str, int, list[int], list[float]]]:
        """(request_id, sample_index, tokens so far, their log-probs) of every running sample, for streaming."""
        return [(s.request_id, s.sample_index, s.tokens, s.logprobs) for s in self._running]

    def abort(self, request_id: int | str) -> None:
        """Drop a request's waiting and running samples (no results are produced for them)."""
        self._waiting = deque(s for s in self._waiting if s.request_id != request_id)
        for seq in [s for s in self._running if s.request_id == request_id]:
            self._release(seq)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the engine also does this by itself when the model's weights change)."""
        self.cache.forget_prefixes()
        for seq in self._running:
            seq.shareable = False  # its latents came from the old weights

    def step(self) -> list[GenerationResult]:
        """Decode one token for each decoding sequence, then prefill (a chunk of) waiting prompts within the
        token budget; a prompt's last chunk gives its first token. Returns the samples that finished."""
        finished: list[GenerationResult] = []
        with self._inference_mode():
            version = self._weights_version()
            if version != self._weights_seen:  # in-place weight update (RL sync, load_state_dict): stale latents
                self._weights_seen = version
                self.reset_prefix_cache()
            decoding = [s for s in self._running if not s.prefilling]
            if decoding:
                finished += self._decode_step(decoding)
            if self._waiting or any(s.prefilling for s in self._running):
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
    def _need(self, seq: _Sequence) -> int:
        """Blocks `seq` must be sure of: with preemption, those its prefill and next decode step write (growth past
        them preempts others, `_make_room`); without, its worst case (prompt + max_tokens)."""
        return self.cache.blocks_for(seq.prefill_target + 1) if self.preemption else seq.reserve

    def _outstanding(self) -> int:
        """Blocks the admitted sequences may still allocate before the next check."""
        return sum(max(self._need(s) - len(s.blocks), 0) for s in self._running)

    def _make_room(self, seqs: list[_Sequence]) -> list[_Sequence]:
        """Preempt the most recently admitted sequences until the cache covers every admitted one's next step;
        returns the decoding `seqs` still running. A victim gives back its blocks and waits at the head of the
        queue with its tokens, its sampler and grammar states; re-admitted, it prefills prompt + tokens again
        (recompute preemption, as vLLM; prefix reuse makes that cheap when its blocks are still cached)."""
        while self.cache.num_available < self._outstanding() and len(self._running) > 1:
            victim = self._running[-1]
            self._release(victim)
            # Its routing records stay: they are the experts that produced its tokens (the recompute adds none).
            victim.cached, victim.hashes, victim.shareable = 0, [], True
            self._waiting.appendleft(victim)
            self.preemptions += 1
        running = {id(s) for s in self._running}
        return [s for s in seqs if id(s) in running]

    def _admit(self, seq: _Sequence) -> bool:
        """Take `seq` into the batch if the cache can hold its worst case; shares its cached prompt prefix."""
        bs = self.cache.block_size
        hashes, matched = [], []
        if self.prefix_caching:  # at least the last position is computed: its logits give token 1
            known = seq.prompt + seq.tokens[:-1]  # a preempted sequence also recomputes its generated tokens
            hashes = prefix_hashes(known, bs, (len(known) - 1) // bs)
            matched = self.cache.match(hashes)
        if self.cache.num_available < self._outstanding() + self._need(seq) - len(matched):
            self.cache.release(matched)
            return False
        self.cache.hits += len(matched)
        seq.blocks, seq.cached, seq.hashes = matched, len(matched) * bs, hashes[: len(matched)]
        if self.record_routing and matched and not seq.routing:  # computed for an earlier request: experts unknown
            seq.routing = [torch.full((seq.cached, self._moe_layers, self.cfg.num_experts_per_tok), -1,
                                      dtype=torch.int16)]
        self._running.append(seq)
        return True

    def _fork(self, lead: _Sequence, seq: _Sequence) -> bool:
        """Give sibling `seq` the leader's prompt cache: its full blocks shared, its partial block copied."""
        bs = self.cache.block_size
        full, rest = divmod(len(lead.prompt), bs)
        if self.cache.num_available < self._outstanding() + self._need(seq) - full:
            return False
        shared = lead.blocks[:full]
        for b in shared:
            self.cache.refs[b] += 1
        seq.blocks, seq.cached, seq.hashes = list(shared), len(lead.prompt), lead.hashes[:full]
        seq.routing = list(lead.routing)  # the prompt's experts: the leader's prefill is the sibling's
        seq.shareable = lead.shareable
        if rest:
            seq.blocks.append(self.cache.allocate())
            self.cache.copy_block(lead.blocks[full], seq.blocks[-1], rest)
        self._running.append(seq)
        return True

    def _prefill_step(self) -> list[GenerationResult]:
        budget = self.max_prefill_tokens
        rows: list[tuple[_Sequence, int]] = []  # (sequence, tokens this step)
        longest = 0

        def take(seq: _Sequence) -> bool:
            nonlocal longest
            left = seq.prefill_target - seq.cached
            width = max(longest, min(left, budget // (len(rows) + 1)))
            if width < 1 or (len(rows) + 1) * width > budget:
                return False
            rows.append((seq, min(left, width)))
            longest = width
            return True

        for seq in [s for s in self._running if s.prefilling]:
            if not take(seq):
                break
        busy = {s.request_id for s in self._running if s.prefilling}  # siblings wait for these to finish
        for seq in list(self._waiting):
            if longest and len(rows) * longest >= budget:
                break
            if seq.request_id in busy:
                continue
            if len(self._running) >= self.max_batch_size or not self._admit(seq):
                break
            self._waiting.remove(seq)
            busy.add(seq.request_id)
            if not take(seq):
                break
        if not rows:
            return []
        logits = self._forward([(s, [s.token_at(i) for i in range(s.cached, s.cached + n)]) for s, n in rows],
                               absorbed=False)
        self.prefill_tokens_computed += sum(n for _, n in rows)
        ready, ready_rows = [], []
        for b, (seq, _) in enumerate(rows):
            if seq.prefilling or seq.tokens:  # tokens: a preempted sequence, recomputed; its next token is drawn
                continue
            ready.append(seq)
            ready_rows.append(b)
            for sib in [w for w in self._waiting if w.request_id == seq.request_id]:
                if len(self._running) >= self.max_batch_size or not self._fork(seq, sib):
                    break
                self._waiting.remove(sib)
                ready.append(sib)
                ready_rows.append(b)
        if not ready:
            return []
        return self._sample_and_check(ready, logits[torch.tensor(ready_rows, device=self.device)])

    def _decode_step(self, seqs: list[_Sequence]) -> list[GenerationResult]:
        if self.preemption:
            seqs = self._make_room(seqs)
        logits = self._forward([(s, [s.tokens[-1]]) for s in seqs], absorbed=self.absorbed)
        return self._sample_and_check(seqs, logits)

    def _sample_and_check(self, seqs: list[_Sequence], logits_BV: torch.Tensor) -> list[GenerationResult]:
        masks = [s.constraint.allowed() if s.constraint is not None else None for s in seqs]
        tokens, logprobs = sample_tokens(logits_BV, [s.params for s in seqs], [s.generator for s in seqs], masks)
        finished = []
        for b, (seq, token, logprob) in enumerate(zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True)):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            if seq.params.return_logits:
                seq.logits.append(logits_BV[b].float().cpu())
            if seq.constraint is not None:
                seq.constraint.advance(token)
            done = self._check_stop(seq, token)
            if done is not None:
                finished.append(seq.result(*done))
                self._release(seq)
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
        if seq.constraint is not None and seq.constraint.is_terminated():
            return "stop", None, self._text(seq, text)
        if len(seq.tokens) >= p.max_tokens:
            return "length", None, self._text(seq, text)
        return None

    def _text(self, seq: _Sequence, text: str | None) -> str | None:
        if self.tokenizer is None:
            return None
        return text if text is not None else self.tokenizer.decode(seq.tokens)

    def _release(self, seq: _Sequence) -> None:
        self._running.remove(seq)
        self.cache.release(seq.blocks)
        seq.blocks = []

    def _weights_version(self) -> tuple[int, int]:
        # Every in-place write to a parameter or buffer bumps its version counter (optimizer steps, copy_), and a
        # replaced one (load_state_dict(assign=True), a new Parameter) changes the identity sum. The modules'
        # own tensor dicts are read directly: model.parameters() walks the module tree through generators, which
        # cost 0.6 ms per decode step on the tiny model (~6% of it), against 0.07 ms for this.
        version = ident = 0
        for tensors in self._weight_dicts:
            for t in tensors.values():
                if t is not None:
                    version += t._version
                    ident += id(t)
        return version, ident

    @property
    def decode_compile_seconds(self) -> dict[int, float]:
        """Wall seconds of each batch bucket's first (compiling) decode step; empty without decode_compile."""
        return dict(self._compiled.compile_s) if self._compiled is not None else {}

    def _decode_step_applies(self) -> bool:
        # A caller may wrap layer forwards, swap modules or add hooks after construction, and those must then run.
        # decode_step.supports walks the module tree; it is re-run only when the layout's change signal moves
        # (_layout_signal), and its answer reused otherwise: 70 us per step instead of 550 on tiny (timeit medians,
        # load ~18; the walk was ~80 us on a quiet machine).
        hooks = torch.nn.modules.module
        if not self.fast_decode or hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
            return False
        if self._layout_signal() != self._layout_seen:
            self._layout = [(m.__dict__, m._modules, tuple(m._modules.values())) for m in self.model.modules()]
            self._layout_ok = decode_step.supports(self.model)
            self._layout_seen = self._layout_signal()
        return self._layout_ok

    def _layout_signal(self) -> tuple[int, bool]:
        # Every hook registration (any module, any kind) takes a handle id from one process-wide counter; an
        # instance-level `forward` or a swapped submodule shows in the module dicts kept from the last check.
        # Writing into a module's hook dicts by hand, bypassing register_*, is not seen.
        same = all("forward" not in d and tuple(kids.values()) == seen for d, kids, seen in self._layout)
        return RemovableHandle.next_id, same

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
    def _forward(self, rows: list[tuple[_Sequence, list[int]]], absorbed: bool) -> torch.Tensor:
        """Append each row's new tokens to its sequence's cache (positions cached..cached+n-1), run the model
        over them (right-padded) and return fp32 logits [B, vocab] at each row's last new token."""
        cache, bs, dev = self.cache, self.cache.block_size, self.device
        lens = [len(ids) for _, ids in rows]
        starts = [seq.cached for seq, _ in rows]
        totals = [s + n for s, n in zip(starts, lens, strict=True)]
        b, t, s_len = len(rows), max(lens), max(totals)
        if s_len > self.max_seq_len:
            raise IndexError(f"sequence would reach {s_len} tokens > max_seq_len={self.max_seq_len}")
        for seq, total in zip((r[0] for r in rows), totals, strict=True):
            while len(seq.blocks) < cache.blocks_for(total):
                seq.blocks.append(cache.allocate())
        # One host-to-tensor copy per input (a decode step's cost is mostly fixed per op, not per element).
        ids_BT = torch.tensor([ids + [0] * (t - len(ids)) for _, ids in rows], device=dev)
        offsets = torch.arange(t, device=dev)
        positions_BT = torch.tensor(starts, device=dev)[:, None] + offsets
        all_valid = all(n == t for n in lens)
        lens_B = None if all_valid else torch.tensor(lens, device=dev)
        valid_BT = None if all_valid else offsets[None, :] < lens_B[:, None]
        if (all_valid and all(n == s_len for n in totals)) or (max(starts) == 0 and t == s_len):
            # No padding and equal ends (every row's queries are its last t positions), or a fresh right-padded
            # prefill (padding follows every real token): plain causal. Equal ends alone are not enough: a row
            # with fewer new tokens (a longer prefix-cache hit) is right-padded, so its queries are not the last t
            # positions (this once hid resumed partial rollouts' own recent tokens from them and broke RL).
            mask_B1TS = None
        else:
            # Key j is visible to new token i of row b iff j <= its position and j < the row's new length.
            key_pos = torch.arange(s_len, device=dev)
            mask = (key_pos <= positions_BT[..., None]) & (key_pos < torch.tensor(totals, device=dev)[:, None, None])
            mask_B1TS = mask[:, None]
        width = cache.blocks_for(s_len)
        table_BK = torch.tensor([seq.blocks[:width] + [0] * (width - len(seq.blocks[:width])) for seq, _ in rows],
                                device=dev)
        key_pos = torch.arange(s_len, device=dev)
        read_rows_BS = table_BK[:, key_pos // bs] * bs + key_pos % bs  # past a row's length: masked, any row
        write_rows = [r for (seq, _), s, n in zip(rows, starts, lens, strict=True)
                      for r in cache.rows(seq.blocks, s, s + n)]
        write_rows_M = torch.tensor(write_rows, device=dev)
        trace = RoutingTrace(self.cfg) if self.record_routing else None
        logits_BV = None
        if t == 1 and absorbed and self._compiled is not None and trace is None and self._decode_step_applies():
            mask_B1S = None if mask_B1TS is None else mask_B1TS[:, :, 0]
            logits_BV = self._compiled(ids_BT[:, 0], positions_BT[:, 0], cache.kv, write_rows_M, read_rows_BS,
                                       mask_B1S, self._scratch_row)
        elif t == 1 and absorbed and self._decode_step_applies():
            mask_B1S = None if mask_B1TS is None else mask_B1TS[:, :, 0]
            hidden_BTD = decode_step.decode_hidden(self.model, ids_BT[:, 0], positions_BT[:, 0], cache, write_rows_M,
                                                   read_rows_BS, mask_B1S, trace)[:, None]
        else:
            attention = LatentCacheAttention(cache, write_rows_M, valid_BT, read_rows_BS, mask_B1TS, absorbed)
            hidden_BTD = self.model.model(ids_BT, positions_BT, inner_attention=attention, routing=trace)
        if trace is not None:
            used_BTLK = trace.used().view(b, t, -1, self.cfg.num_experts_per_tok).to("cpu", torch.int16)
            for i, (seq, start, n) in enumerate(zip((r[0] for r in rows), starts, lens, strict=True)):
                known = sum(len(r) for r in seq.routing)  # > start after a preemption: those stay as recorded
                if start + n > known:
                    seq.routing.append(used_BTLK[i, max(known - start, 0):n])
        for (seq, _), total in zip(rows, totals, strict=True):
            seq.cached = total
            if self.prefix_caching and seq.shareable:
                self._name_full_blocks(seq)
        if logits_BV is not None:
            return logits_BV
        last_BD = hidden_BTD[:, -1] if all_valid else hidden_BTD[torch.arange(b, device=dev), lens_B - 1]
        return self.model.lm_head(last_BD).float()

    def _name_full_blocks(self, seq: _Sequence) -> None:
        """Register the sequence's newly filled blocks in the prefix table (prompt and generated tokens alike:
        the next turn of a conversation starts with both)."""
        bs = self.cache.block_size
        while len(seq.hashes) < seq.cached // bs:
            k = len(seq.hashes)
            parent = seq.hashes[-1] if seq.hashes else ROOT_HASH
            seq.hashes.append(block_hash(parent, [seq.token_at(i) for i in range(k * bs, (k + 1) * bs)]))
            self.cache.register(seq.blocks[k], seq.hashes[-1])


def _find_stop(text: str, stops: Sequence[str], scan_from: int) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in text[scan_from:], or None."""
    best = None
    for stop in stops:
        i = text.find(stop, scan_from)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best
