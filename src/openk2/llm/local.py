"""`LocalChatModel`: the openk2 `Engine` on a checkpoint, behind the `ChatModel` interface.

It renders with K2's chat template, samples with the engine and parses K2 tool calls, just as `openk2 serve`
does (same stop tokens, same `tool_choice` handling, the same llguidance grammars for `response_format` and forced
or strict tool calls), but in-process. A constrained sample's last tokens close its JSON (`openk2.llm.finisher`),
so a structured reply parses whenever the budget allows its shortest completion. One call runs one `engine.generate`;
concurrent calls (threads or `achat`) take turns on a lock. `chat_batch` samples many conversations in one
batch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openk2.chat import ChatFormat
from openk2.llm.base import ChatModel, ChatResponse

_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_tokens", "n", "stop", "seed"}


class LocalChatModel(ChatModel):
    """`source`: a checkpoint directory or an `(engine, tokenizer)` pair; `tool_parser`: a registered format."""

    def __init__(self, source: str | Path | tuple[Any, Any], max_batch_size: int = 8, max_seq_len: int = 2048,
                 device: str | None = None, dtype: str | None = None, default_max_tokens: int = 512,
                 tool_parser: str = "kimi_k2", strict_tool_calls: bool = False,
                 max_string_length: int | None = None) -> None:
        if isinstance(source, tuple):
            self.engine, self.tokenizer = source
            self.name = "local"
        else:
            import torch

            from openk2.data.tokenizer import K2Tokenizer
            from openk2.infer.engine import Engine
            from openk2.model import K2ForCausalLM

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            torch_dtype = getattr(torch, dtype) if dtype else (
                torch.bfloat16 if device.startswith("cuda") else torch.float32)
            model = K2ForCausalLM.from_pretrained(source, dtype=torch_dtype, device=device).eval()
            self.tokenizer = K2Tokenizer.load(source)
            self.engine = Engine(model, tokenizer=self.tokenizer, max_batch_size=max_batch_size,
                                 max_seq_len=max_seq_len)
            self.name = f"local:{source}"
        self.format = ChatFormat(self.tokenizer, tool_parser)
        self.default_max_tokens = default_max_tokens
        self.strict_tool_calls = strict_tool_calls  # `auto` calls held to the grammar once a call section opens
        self.max_string_length = max_string_length  # caps free strings in constrained JSON
        self._lock = threading.Lock()
        self._token_bytes: list[bytes] | None = None

    def _prepare(self, messages: Sequence[dict], tools: Sequence[dict] | None, sampling: dict):
        from openk2.infer.sampling import SamplingParams

        sampling = dict(sampling)
        choice = sampling.pop("tool_choice", None)
        response_format = sampling.pop("response_format", None)
        parallel = sampling.pop("parallel_tool_calls", None)
        if sampling.pop("max_completion_tokens", None) is not None:
            raise ValueError("use max_tokens")
        unknown = set(sampling) - _SAMPLING_KEYS
        if unknown:
            raise ValueError(f"unsupported sampling options: {sorted(unknown)}")
        prepared = self.format.prepare(messages, tools, choice)
        prompt = prepared.token_ids
        stop = sampling.pop("stop", None) or ()
        max_tokens = sampling.pop("max_tokens", None)
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, self.engine.max_seq_len - len(prompt))
        params = SamplingParams(max_tokens=max_tokens, stop=(stop,) if isinstance(stop, str) else tuple(stop),
                                stop_token_ids=prepared.stop_token_ids, **sampling)
        strict = self.strict_tool_calls and bool(tools) and choice in (None, "auto")
        if response_format is not None or choice not in (None, "auto", "none") or strict:
            # Forced tool calls and JSON replies follow their grammar, as in `openk2 serve`.
            from openk2.infer.grammar import reply_constraint

            vocab = getattr(getattr(getattr(self.engine, "model", None), "config", None), "vocab_size", None)
            factory = reply_constraint(self.tokenizer, vocab or self.tokenizer.vocab_size, tools, choice,
                                       response_format, strict_auto=strict, max_string_length=self.max_string_length,
                                       parallel_tool_calls=parallel)
            params.constraint = self._budgeted(factory, max_tokens, tools, response_format)
        return prompt, prepared.prefix, params

    def _budgeted(self, factory: Any, max_tokens: int, tools: Sequence[dict] | None,
                  response_format: dict | None) -> Any:
        """`factory`'s constraints, each closing its reply within `max_tokens` (openk2.llm.finisher)."""
        if factory is None:
            return None
        from openk2.chat.grammar import response_schema, tool_schema
        from openk2.llm.finisher import BudgetedConstraint, Finisher, reserve_for

        _, schema = response_schema(response_format)
        schemas = [schema] if schema is not None else [tool_schema(t) for t in tools or ()] or [None]
        reserve = min(max_tokens // 2, max(reserve_for(s) for s in schemas) + 4)  # + call and section ends
        if self._token_bytes is None:
            from openk2.infer.grammar import token_bytes

            self._token_bytes = token_bytes(self.tokenizer)
        tokens = self._token_bytes
        specials = [i for i, b in enumerate(tokens) if b.startswith(b"\xff")]
        ends = [i for i in (self.tokenizer.eos_id, self.tokenizer.special_ids.get("<|im_end|>")) if i is not None]

        def build() -> BudgetedConstraint:
            return BudgetedConstraint(factory(), Finisher(tokens, ends, max_tokens, reserve, specials))

        return build

    def _response(self, result: Any, prefix: str, usage: dict, tools: Sequence[dict] | None) -> ChatResponse:
        reply = self.format.finish(result, prefix, tools)
        return ChatResponse(content=reply.content, tool_calls=reply.tool_calls, finish_reason=reply.finish_reason,
                            usage=usage)

    def chat_batch(self, conversations: Sequence[Sequence[dict]], tools: Sequence[dict] | None = None,
                   **sampling: Any) -> list[list[ChatResponse]]:
        """`chat` for many conversations at once (one engine batch); one list of n responses per conversation."""
        prepared = [self._prepare(m, tools, sampling) for m in conversations]
        with self._lock:
            results = self.engine.generate([p[0] for p in prepared], [p[2] for p in prepared])
        out: list[list[ChatResponse]] = [[] for _ in prepared]
        for k, (prompt, prefix, _params) in enumerate(prepared):
            mine = [r for r in results if r.request_id == k]
            done = sum(len(r.token_ids) for r in mine)
            usage = {"prompt_tokens": len(prompt), "completion_tokens": done, "total_tokens": len(prompt) + done}
            out[k] = [self._response(r, prefix, usage, tools) for r in sorted(mine, key=lambda r: r.sample_index)]
        return out

    def chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
             **sampling: Any) -> list[ChatResponse]:
        return self.chat_batch([messages], tools, **sampling)[0]
