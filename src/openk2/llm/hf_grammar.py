"""Constrained decoding for the `hf:` backend: llguidance (the server's grammar library) over a transformers model.

What the grammar holds a reply to (the completion after the chat template's generation prompt):

    response_format json_schema   one JSON value of the schema (compact), then EOS
    response_format json_object   one JSON object, then EOS
    tool_choice "required"        {"name": "NAME", "arguments": ARGS(NAME)} for one declared tool, then EOS
    tool_choice {function: NAME}  {"name": "NAME", "arguments": ARGS(NAME)}, then EOS
    "auto" with strict calls      either that call object, or free text that does not start with "{"

ARGS is the tool's `parameters` schema (tightened as the server does: listed properties only, free strings
capped). The call object is the bare-JSON shape `parse_tool_calls` reads, so a constrained call always becomes
an OpenAI `tool_calls` entry. One call per reply. `GrammarLogits` is the `LogitsProcessor`: one llguidance
matcher per row, the mask applied before each draw, and a `Finisher` for the last tokens of the budget.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from typing import Any

from openk2.chat.grammar import ANY_OBJECT, response_schema, tighten, tool_name, tool_schema
from openk2.llm.finisher import Finisher, reserve_for

_JSON_OPTIONS = {"whitespace_flexible": False}
_LOCK = threading.Lock()
DEFAULT_MAX_STRING_LENGTH = 256  # free strings in constrained replies (a rambling small model still closes them)


@functools.lru_cache(maxsize=4)
def _lltokenizer_cached(key: int, tokenizer: Any) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


def hf_lltokenizer(tokenizer: Any) -> Any:
    """llguidance's view of a transformers fast tokenizer (built once per tokenizer: ~1 s)."""
    with _LOCK:
        return _lltokenizer_cached(id(tokenizer), tokenizer)


def _json_rule(schema: dict) -> str:
    body = dict(schema)
    body["x-guidance"] = dict(_JSON_OPTIONS, **body.get("x-guidance", {}))
    return "%json " + json.dumps(body, sort_keys=True)


def call_prefix(name: str) -> str:
    """The literal text a constrained call to `name` starts with."""
    return '{"name": ' + json.dumps(name) + ', "arguments": '


def hf_grammar(tools: Sequence[dict] | None, tool_choice: Any, response_format: dict | None, strict_auto: bool,
               max_string_length: int | None = DEFAULT_MAX_STRING_LENGTH) -> tuple[str, int, str] | None:
    """(Lark grammar, closing reserve in tokens, kind) for a reply, or None when the reply is free text; kind is
    "json" (a JSON value), "call" (one call object) or "auto" (a call object or text)."""
    constrained, schema = response_schema(response_format)
    tools = list(tools or [])
    if tools and tool_choice not in (None, "auto", "none"):
        if isinstance(tool_choice, dict):
            name = tool_choice.get("function", {}).get("name")
            chosen = [t for t in tools if tool_name(t) == name]
            if not chosen:
                raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        elif tool_choice == "required":
            chosen = tools
        else:
            raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or a named function, not {tool_choice!r}")
        return (*_calls(chosen, max_string_length, free_text=False), "call")
    if constrained:
        schema = tighten(schema or ANY_OBJECT, max_string_length)
        return f"start: value\nvalue: {_json_rule(schema)}\n", reserve_for(schema), "json"
    if tools and strict_auto and tool_choice != "none":
        return (*_calls(tools, max_string_length, free_text=True), "auto")
    return None


def _calls(tools: Sequence[dict], max_string_length: int | None, free_text: bool) -> tuple[str, int]:
    rules, alts, reserve = [], [], 0
    for i, tool in enumerate(tools):
        schema = tighten(tool_schema(tool), max_string_length)
        rules.append(f"call_{i}: {json.dumps(call_prefix(tool_name(tool)))} args_{i} \"}}\"")
        rules.append(f"args_{i}: {_json_rule(schema)}")
        alts.append(f"call_{i}")
        reserve = max(reserve, len(call_prefix(tool_name(tool))) + reserve_for(schema) + 1)
    if free_text:
        alts.append("TEXT")
        rules.append(r"TEXT: /[^{\s][\s\S]*/")
    return "start: " + " | ".join(alts) + "\n" + "\n".join(rules) + "\n", reserve


def check_grammar(tokenizer: Any, lark: str) -> None:
    """ValueError (one line) if llguidance cannot compile `lark`."""
    import llguidance

    matcher = llguidance.LLMatcher(hf_lltokenizer(tokenizer), llguidance.LLMatcher.grammar_from_lark(lark),
                                   log_level=0)
    if matcher.is_error():
        raise ValueError(f"grammar does not compile: {matcher.get_error().splitlines()[0]}")


class RowGrammar:
    """One sample's grammar state: its llguidance matcher and its `Finisher`."""

    def __init__(self, matcher: Any, finisher: Finisher) -> None:
        self.matcher, self.finisher = matcher, finisher


@functools.lru_cache(maxsize=256)
def _compiled(key: int, tokenizer: Any, lark: str) -> Any:
    """A fresh matcher for `lark`, compiled once per (tokenizer, grammar); callers use `deep_copy`s of it."""
    import llguidance

    return llguidance.LLMatcher(hf_lltokenizer(tokenizer), llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)


def row_grammars(tokenizer: Any, lark: str, rows: int, max_tokens: int, reserve: int,
                 end_ids: Sequence[int]) -> list[RowGrammar]:
    """`rows` fresh grammar states for `lark`; ValueError (one line) if it does not compile."""
    template = _compiled(id(tokenizer), tokenizer, lark)
    if template.is_error():
        raise ValueError(f"grammar does not compile: {template.get_error().splitlines()[0]}")
    tokens, specials = _vocab(tokenizer)
    return [RowGrammar(template.deep_copy(), Finisher(tokens, end_ids, max_tokens, min(reserve, max_tokens // 2),
                                                      specials)) for _ in range(rows)]


class GrammarLogits:
    """A transformers `LogitsProcessor` for a batch whose rows start after `prompt_len` (left-padded): row i
    follows `grammars[i]` (None: free) and ends after `budgets[i]` tokens (EOS is forced then).

    transformers runs custom processors after its own top-k/top-p, which could remove every allowed token; so
    constrained sampling passes none to `generate` and `temperature`, `top_k`, `top_p` are applied here, after
    the mask."""

    def __init__(self, tokenizer: Any, grammars: Sequence[RowGrammar | None], budgets: Sequence[int],
                 prompt_len: int, end_ids: Sequence[int], temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None) -> None:
        import llguidance.torch as lgt

        self.vocab = hf_lltokenizer(tokenizer).vocab_size
        self.grammars, self.budgets = list(grammars), list(budgets)
        self.end_ids = list(end_ids)
        self.prompt_len = prompt_len
        self._bits = lgt.allocate_token_bitmask(1, self.vocab)
        self.temperature = temperature if temperature > 0 else 1.0
        self.top_k, self.top_p = top_k, top_p
        self.warp = any(g is not None for g in self.grammars)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import llguidance.torch as lgt
        import torch

        step = input_ids.shape[1] - self.prompt_len
        out = scores.clone()
        shift = torch.arange(32, dtype=torch.int32)
        for row in range(scores.shape[0]):
            g = self.grammars[row]
            if step >= self.budgets[row]:
                out[row] = float("-inf")
                out[row, self.end_ids[0]] = 0.0
                continue
            if g is None:
                if self.warp:  # generate's own warpers are off for this batch
                    out[row] = self._warp(scores[row])
                continue
            matcher, fin = g.matcher, g.finisher
            if step > 0:
                last = int(input_ids[row, -1])
                if not (matcher.is_stopped() or matcher.is_error()):
                    matcher.consume_token(last)
                fin.advance(last)
            out[row] = float("-inf")
            if matcher.is_stopped() or matcher.is_error():
                out[row, self.end_ids[0]] = 0.0
                continue
            lgt.fill_next_token_bitmask(matcher, self._bits)
            n = min(self.vocab, scores.shape[1])
            mask = ((self._bits[0][:, None] >> shift) & 1).flatten()[:n].bool()
            if not bool(mask.any()):
                out[row, self.end_ids[0]] = 0.0
            elif fin.finishing:
                out[row, fin.pick(mask.nonzero().flatten().tolist())] = 0.0
            else:
                out[row, :n] = self._warp(torch.where(mask, scores[row, :n], out[row, :n]))
        return out

    def _warp(self, logits: Any) -> Any:
        """Temperature, then top-k and top-p, over one row's allowed logits (at least one token survives)."""
        import torch

        logits = logits / self.temperature
        if self.top_k:
            k = min(int(self.top_k), logits.numel())
            kth = torch.topk(logits, k).values[-1]
            logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
        if self.top_p is not None and self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            drop = torch.cumsum(probs, dim=-1) - probs > self.top_p  # keep the smallest set reaching top_p
            logits = logits.clone()
            logits[order[drop]] = float("-inf")
        return logits


@functools.lru_cache(maxsize=4)
def _vocab_cached(key: int, tokenizer: Any) -> tuple[list[bytes], list[int]]:
    lt = hf_lltokenizer(tokenizer)
    tokens = [lt.decode_bytes([i]) for i in range(lt.vocab_size)]
    return tokens, [i for i in range(lt.vocab_size) if lt.is_special_token(i)]


def _vocab(tokenizer: Any) -> tuple[list[bytes], list[int]]:
    """(bytes of every token, special token ids) of a transformers tokenizer, built once."""
    return _vocab_cached(id(tokenizer), tokenizer)


