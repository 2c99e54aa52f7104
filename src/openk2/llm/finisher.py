"""Closing a constrained JSON reply before the token budget runs out.

A grammar makes every token valid, but a reply cut off by `max_tokens` mid-string still does not parse. So the
last `reserve` tokens of a constrained sample are not drawn from the model: `Finisher.pick` chooses, among the
tokens the grammar allows, the one that closes the value fastest (end of reply, then `}` `]` `,`, a quote that
ends an open string, the shortest scalar). `reserve_for(schema)` bounds what closing can take from any point:
the length in characters (a token is at least one) of the schema's smallest instance with every property
present (a sample may have opened any optional one), plus a margin. With `max_tokens >= 2 * reserve_for(schema)`
every constrained reply ends as JSON of the schema.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# Outside a string: the first byte of the token preferred, best first (the grammar says which are allowed).
_OUTSIDE = b'}],"0123456789tfn'
_MARGIN = 8  # tokens on top of the smallest instance: nesting closers and the reply's end


def smallest_instance(schema: Any, depth: int = 0, every_property: bool = False) -> Any:
    """The shortest JSON value `schema` admits (required properties only, or all with `every_property`;
    the shortest enum member; empty strings and arrays where allowed), roughly."""
    if not isinstance(schema, dict) or depth > 16:
        return None
    for key in ("const",):
        if key in schema:
            return schema[key]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min(schema["enum"], key=lambda v: len(json.dumps(v)))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            options = [smallest_instance(s, depth + 1, every_property) for s in schema[key]]
            return min(options, key=lambda v: len(json.dumps(v)))
    kind = schema.get("type", "object" if "properties" in schema else None)
    kind = min(kind, key=len) if isinstance(kind, list) and kind else kind
    if kind == "object":
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        keys = list(props) if every_property else list(schema.get("required", []) or [])
        return {k: smallest_instance(props.get(k, {}), depth + 1, every_property) for k in keys}
    if kind == "array":
        return [smallest_instance(schema.get("items", {}), depth + 1, every_property)
                for _ in range(int(schema.get("minItems", 0)))]
    if kind == "string":
        return "x" * int(schema.get("minLength", 0))
    if kind in ("integer", "number"):
        return 0
    if kind == "boolean":
        return True
    return None


def reserve_for(schema: Any) -> int:
    """Tokens to hold back for closing a reply of `schema` (see the module docstring)."""
    return len(json.dumps(smallest_instance(schema, every_property=True), separators=(",", ":"))) + _MARGIN


class Finisher:
    """Picks closing tokens for one sample once fewer than `reserve` of its `max_tokens` are left.

    `token_bytes[i]` is token i's bytes (special tokens may be anything; they count as closers when their name
    says `end`), `end_ids` the tokens that end the reply. Feed every drawn token to `advance`.
    """

    def __init__(self, token_bytes: Sequence[bytes], end_ids: Sequence[int], max_tokens: int, reserve: int,
                 special_ids: Sequence[int] = ()) -> None:
        self.token_bytes = token_bytes
        self.end_ids = set(end_ids)
        self.special_ids = set(special_ids)
        self.start_at = max(0, max_tokens - reserve)
        self.steps = 0
        self.in_string = False
        self._escape = False

    @property
    def finishing(self) -> bool:
        return self.steps >= self.start_at

    def advance(self, token: int, in_grammar: bool = True) -> None:
        """Track the drawn token (string state for the quote rule; free text before a lazy grammar's trigger
        only counts against the budget)."""
        self.steps += 1
        if not in_grammar or token in self.special_ids or token in self.end_ids:
            return
        for byte in self.token_bytes[token]:
            if self._escape:
                self._escape = False
            elif self.in_string and byte == 0x5C:  # backslash
                self._escape = True
            elif byte == 0x22:  # quote
                self.in_string = not self.in_string

    def pick(self, allowed: Sequence[int]) -> int:
        """The allowed token that closes the reply fastest."""
        if not allowed:
            raise ValueError("the grammar allows no token")
        ends = [t for t in allowed if t in self.end_ids]
        if ends:
            return min(ends)
        closers = [t for t in allowed if t in self.special_ids and b"end" in self.token_bytes[t]]
        if closers:
            return min(closers)
        order = b'"' if self.in_string else _OUTSIDE
        best: dict[int, tuple[int, int]] = {}
        for t in allowed:
            data = self.token_bytes[t]
            if not data or t in self.special_ids:
                continue
            rank = order.find(data[:1])
            if rank >= 0 and (rank not in best or (len(data), t) < best[rank]):
                best[rank] = (len(data), t)
        if best:
            return best[min(best)][1]
        # Nothing that closes: forced text (a key, a literal) or a string below its minLength; the longest token
        # gets there in the fewest steps.
        plain = [t for t in allowed if t not in self.special_ids and self.token_bytes[t]]
        return max(plain or allowed, key=lambda t: (len(self.token_bytes[t]), -t))


class BudgetedConstraint:
    """A `Constraint` (openk2.infer.sampling) that lets `Finisher` choose the last tokens of the budget."""

    def __init__(self, inner: Any, finisher: Finisher) -> None:
        self.inner, self.finisher = inner, finisher

    def allowed(self) -> Any:
        """The inner mask, narrowed to the finisher's pick once the budget is nearly spent."""
        mask = self.inner.allowed()
        if mask is None or not self.finisher.finishing:
            return mask
        pick = self.finisher.pick(mask.nonzero().flatten().tolist())
        out = mask.new_zeros(mask.shape)
        out[pick] = True
        return out

    def advance(self, token: int) -> None:
        """Feed the drawn token to both."""
        self.finisher.advance(token, in_grammar=getattr(self.inner, "active", True))
        self.inner.advance(token)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()
