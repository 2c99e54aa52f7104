"""The `ChatModel` interface: one call shape for our own engine and any OpenAI-compatible endpoint."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChatResponse:
    """One sampled assistant turn. `tool_calls` are in OpenAI's message shape
    (`{"id", "type": "function", "function": {"name", "arguments"}}`); `usage` holds prompt_tokens,
    completion_tokens and total_tokens (for the whole request, shared by its n responses)."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)

    def message(self) -> dict:
        """The turn as an OpenAI assistant message, ready to append to the conversation."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


class ChatModel(ABC):
    """`chat(messages, tools=None, **sampling) -> list[ChatResponse]` (one per sample, n of them).

    Sampling keywords (OpenAI names): temperature, top_p, max_tokens, n, stop, seed, tool_choice; backends may
    accept more (top_k for the local engine). `achat` is the asyncio form; its default runs `chat` in a thread.
    """

    name: str = "chat-model"

    @abstractmethod
    def chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
             **sampling: Any) -> list[ChatResponse]:
        ...

    async def achat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    **sampling: Any) -> list[ChatResponse]:
        return await asyncio.to_thread(self.chat, messages, tools, **sampling)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release clients or engines (optional)."""
