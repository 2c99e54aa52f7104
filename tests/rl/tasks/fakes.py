"""A deterministic fake ChatModel for pipeline logic: a Python function maps the last user message to a reply."""

from collections.abc import Callable

from openk2.llm.base import ChatModel, ChatResponse


class FakeChat(ChatModel):
    name = "fake"

    def __init__(self, reply: Callable[[str], str | list[str]]):
        self.reply, self.calls = reply, []

    def chat(self, messages, tools=None, **sampling):
        self.calls.append((messages, sampling))
        out = self.reply(messages[-1]["content"])
        texts = out if isinstance(out, list) else [out] * sampling.get("n", 1)
        return [ChatResponse(content=t, finish_reason="stop") for t in texts]
