"""Constrained decoding with llguidance behind the engine's `Constraint` hook (openk2.infer.sampling).

`grammar_constraint(tokenizer, lark, vocab_size)` compiles a Lark grammar (openk2.chat.grammar writes them) once
and returns a factory for `SamplingParams.constraint`: each sample gets its own copy of the matcher, whose
token mask (a bitmask over the tokenizer's vocabulary, unpacked to a bool [vocab_size]) restricts every draw,
and which advances on the token drawn. `trigger_id` makes it lazy (strict `auto` tool calls): any token is
allowed until the trigger token is drawn, and the grammar holds from the token after it.

Why llguidance (benchmarks/bench_grammar.py, docs/benchmarks.md): it installs from PyPI as one CPU wheel with
no torch or compiler dependency, it addresses special tokens in the grammar (`<|tool_call_end|>` is one token,
never text that spells it), its JSON-schema compiler is lazy (no per-schema vocabulary pass), and it measured
the fastest per-token masks on openk2's tokenizer.

The tokenizer's vocabulary is handed over as bytes per id: byte-level BPE tokens as their bytes, special tokens
as 0xFF + name (llguidance's marking for special tokens).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

log = logging.getLogger("openk2.grammar")

_SPECIAL_MARK = b"\xff"
_CACHE: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> (tokenizer, LLTokenizer)
_LOCK = threading.Lock()


def _byte_decoder() -> dict[str, int]:
    # GPT-2's printable stand-ins for bytes (what HF's ByteLevel pre-tokenizer writes into the vocabulary).
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def token_bytes(tokenizer: Any) -> list[bytes]:
    """The bytes of every token id of an openk2 K2Tokenizer (special tokens as 0xFF + name)."""
    special = {i: name for name, i in tokenizer.special_ids.items()}
    base = getattr(tokenizer, "num_base_tokens", tokenizer.vocab_size)
    for i in range(base, tokenizer.vocab_size):  # K2's special block: reserved slots are special too
        special.setdefault(i, tokenizer.decode([i]))
    backend = getattr(tokenizer, "_backend", None)
    enc, hf = getattr(backend, "enc", None), getattr(backend, "tok", None)
    decoder = _byte_decoder() if hf is not None else None
    out = []
    for i in range(tokenizer.vocab_size):
        if i in special:
            out.append(_SPECIAL_MARK + special[i].encode())
        elif enc is not None:
            out.append(enc.decode_single_token_bytes(i))
        elif hf is not None:
            piece = hf.id_to_token(i)
            out.append(bytes(decoder[ch] for ch in piece) if piece is not None else _SPECIAL_MARK + b"<unk>")
        else:  # a tokenizer of unknown make: its decoded text (exact for tokens that are whole characters)
            out.append(tokenizer.decode([i]).encode())
    return out


def lltokenizer(tokenizer: Any) -> Any:
    """llguidance's view of `tokenizer` (built once per tokenizer object: ~1 s for K2's 160K vocabulary)."""
    import llguidance

    with _LOCK:
        hit = _CACHE.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]

        class _Wrapped:
            eos_token_id = tokenizer.eos_id
            bos_token_id = None
            tokens = token_bytes(tokenizer)
            special_token_ids = [i for i, b in enumerate(tokens) if b.startswith(_SPECIAL_MARK)]

            def __call__(self, text: str | bytes) -> list[int]:
                if isinstance(text, bytes):
                    text = text.decode("utf-8", errors="replace")
                return tokenizer.encode(text, allow_special=False)

        lt = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped()), n_vocab=tokenizer.vocab_size)
        _CACHE[id(tokenizer)] = (tokenizer, lt)
        return lt


def supported_schema(tokenizer: Any, schema: dict) -> bool:
    """Whether llguidance's JSON-schema compiler accepts `schema`."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except (ValueError, TypeError):
        return False
    is_error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltokenizer(tokenizer))
    return not is_error


def usable_schemas(tokenizer: Any, tools: Sequence[dict], max_string_length: int | None = None) -> dict[str, dict]:
    """Each tool's argument schema for generation (`chat.grammar.tighten`), or any JSON object (with a warning)
    where llguidance cannot compile it."""
    from openk2.chat.grammar import ANY_OBJECT, tighten, tool_name, tool_schema, without_keywords

    out = {}
    for tool in tools:
        schema = tighten(tool_schema(tool), max_string_length)
        if not supported_schema(tokenizer, schema):
            schema = without_keywords(schema)  # e.g. uniqueItems: keep every constraint the grammar can hold
        if not supported_schema(tokenizer, schema):
            log.warning("tool %r: parameters schema not supported by the grammar compiler; constraining its "
                        "arguments to any JSON object", tool_name(tool))
            schema = dict(ANY_OBJECT)
        out[tool_name(tool)] = schema
    return out


class GrammarConstraint:
    """One sample's grammar state (a `Constraint`): llguidance's mask before each draw, its advance after."""

    def __init__(self, matcher: Any, matcher_vocab: int, vocab_size: int, fallback_ids: Sequence[int],
                 trigger_id: int | None = None) -> None:
        import llguidance.torch as lgt

        self.matcher, self.vocab_size = matcher, vocab_size
        self.fallback_ids = list(fallback_ids)
        self.trigger_id = trigger_id  # None: the grammar holds from the first token
        self._bits = lgt.allocate_token_bitmask(1, matcher_vocab)
        self._matcher_vocab = matcher_vocab
        self._shift = torch.arange(32, dtype=torch.int32)

    @property
    def active(self) -> bool:
        return self.trigger_id is None

    def allowed(self) -> torch.Tensor | None:
        """Bool [vocab_size] of the tokens the grammar allows next (None before the trigger)."""
        if not self.active:
            return None
        import llguidance.torch as lgt

        if not self.matcher.is_error():
            lgt.fill_next_token_bitmask(self.matcher, self._bits)
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)  # ids past the tokenizer's: never allowed
            n = min(self._matcher_vocab, self.vocab_size)
            mask[:n] = ((self._bits[0][:, None] >> self._shift) & 1).flatten()[:n].bool()
            if bool(mask.any()):
                return mask
        # A matcher in error (it never should be: every token drawn was allowed) ends the sample at once.
        log.warning("grammar matcher stuck: %s", self.matcher.get_error() or "no token allowed")
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.fallback_ids] = True
        return mask

    def advance(self, token: int) -> None:
        """Feed the token drawn to the matcher (or watch for the trigger)."""
        if not self.active:
            if token == self.trigger_id:
                self.trigger_id = None
            return
        self.matcher.consume_token(token)

    def is_terminated(self) -> bool:
        """True once the grammar is complete or the matcher failed."""
        return self.active and (self.matcher.is_stopped() or self.matcher.is_error())


def grammar_constraint(tokenizer: Any, lark: str, vocab_size: int | None = None,
                       trigger_id: int | None = None) -> Callable[[], GrammarConstraint]:
    """A `SamplingParams.constraint` factory for a Lark grammar; ValueError (one line) if it does not compile."""
    import llguidance

    lt = lltokenizer(tokenizer)
    template = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    if template.is_error():
        raise ValueError(f"grammar does not compile: {template.get_error().splitlines()[0]}")
    vocab = vocab_size or tokenizer.vocab_size
    fallback = [tokenizer.eos_id]

    def build() -> GrammarConstraint:
        return GrammarConstraint(template.deep_copy(), tokenizer.vocab_size, vocab, fallback, trigger_id)

    return build


def reply_constraint(tokenizer: Any, vocab_size: int, tools: Sequence[dict] | None, tool_choice: str | dict | None,
                     response_format: dict | None = None, strict_auto: bool = False,
                     max_string_length: int | None = None,
                     parallel_tool_calls: bool | None = None) -> Callable[[], GrammarConstraint] | None:
    """The `SamplingParams.constraint` a chat request needs (None: unconstrained): forced tool calls, strict
    `auto` calls, or a JSON reply (see openk2.chat.grammar). ValueError (one line) for a bad response_format."""
    from openk2.chat.grammar import TRIGGER, reply_grammar, response_schema, tighten

    constrained, schema = response_schema(response_format)
    if constrained and schema is not None:
        schema = tighten(schema, max_string_length)
        if not supported_schema(tokenizer, schema):
            raise ValueError("response_format json_schema uses features the grammar compiler does not support")
        response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
    schemas = usable_schemas(tokenizer, tools, max_string_length) if tools else {}
    spec = reply_grammar(tools, tool_choice, response_format, strict_auto, schemas, parallel_tool_calls)
    if spec is None:
        return None
    lark, trigger = spec
    trigger_id = tokenizer.special_ids[TRIGGER] if trigger is not None else None
    return grammar_constraint(tokenizer, lark, vocab_size, trigger_id)
