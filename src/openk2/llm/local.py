"""`LocalChatModel`: the openk2 `Engine` on a checkpoint, behind the `ChatModel` interface.

It renders with K2's chat template, samples with the engine and parses K2 tool calls, just as `openk2 serve`
does (same stop tokens, same `tool_choice` handling), but in-process. One call runs one `engine.generate`;
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
                 tool_parser: str = "kimi_k2") -> None:
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
        self._lock = threading.Lock()

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
        if response_format is not None or choice not in (None, "auto", "none"):
            # Forced tool calls and JSON replies follow their grammar, as in `openk2 serve`.
            from openk2.infer.grammar import reply_constraint

            vocab = getattr(getattr(getattr(self.engine, "model", None), "config", None), "vocab_size", None)
            params.constraint = reply_constraint(self.tokenizer, vocab or self.tokenizer.vocab_size, tools, choice,
                                                 response_format, parallel_tool_calls=parallel)
        return prompt, prepared.prefix, params

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
