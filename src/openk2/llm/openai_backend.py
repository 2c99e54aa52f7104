"""`OpenAIChatModel`: any OpenAI-compatible chat endpoint (OpenAI, vLLM, SGLang, `openk2 serve`).

Uses the official `openai` client, which retries connection errors, 408/409/429 and 5xx with exponential
backoff (`max_retries`) and applies `timeout` per request: the one retry layer of every job that calls a model
(`openk2.llm.transport` says what still failing after it means). At most `max_concurrency` requests are in flight
per model object (a thread semaphore for `chat`, an asyncio semaphore for `achat`).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from typing import Any

from openk2.llm.base import ChatModel, ChatResponse


class OpenAIChatModel(ChatModel):
    def __init__(self, base_url: str | None = None, model: str | None = None, api_key: str | None = None,
                 timeout: float = 120.0, max_retries: int = 3, max_concurrency: int = 8) -> None:
        import openai

        api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self._client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=max_retries)
        self._aclient = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout,
                                           max_retries=max_retries)
        self.max_concurrency = max_concurrency
        self._sem = threading.BoundedSemaphore(max_concurrency)
        self._asems: dict[int, asyncio.Semaphore] = {}  # one per event loop
        if model is None:
            models = self._client.models.list().data
            if not models:
                raise ValueError(f"{base_url} lists no models; give one as 'openai:URL#MODEL'")
            model = models[0].id
        self.model = model
        self.name = f"openai:{base_url}#{model}"

    def _kwargs(self, messages: Sequence[dict], tools: Sequence[dict] | None, sampling: dict) -> dict:
        kw = {"model": self.model, "messages": list(messages), **sampling}
        if tools:
            kw["tools"] = list(tools)
        return kw

    @staticmethod
    def _responses(completion: Any) -> list[ChatResponse]:
        u = completion.usage
        usage = ({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                  "total_tokens": u.total_tokens} if u is not None else {})
        out = []
        for c in sorted(completion.choices, key=lambda c: c.index):
            calls = [{"id": t.id, "type": "function",
                      "function": {"name": t.function.name, "arguments": t.function.arguments}}
                     for t in c.message.tool_calls or []]
            out.append(ChatResponse(content=c.message.content, tool_calls=calls, finish_reason=c.finish_reason,
                                    usage=usage))
        return out

    def chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
             **sampling: Any) -> list[ChatResponse]:
        with self._sem:
            return self._responses(self._client.chat.completions.create(**self._kwargs(messages, tools, sampling)))

    async def achat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    **sampling: Any) -> list[ChatResponse]:
        loop = id(asyncio.get_running_loop())
        sem = self._asems.setdefault(loop, asyncio.Semaphore(self.max_concurrency))
        async with sem:
            completion = await self._aclient.chat.completions.create(**self._kwargs(messages, tools, sampling))
        return self._responses(completion)

    def close(self) -> None:
        self._client.close()
