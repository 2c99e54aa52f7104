"""Chat models behind one interface: `load_chat_model("local:PATH" | "openai:URL#MODEL")`."""

from openk2.llm.base import ChatModel, ChatResponse
from openk2.llm.registry import load_chat_model

__all__ = ["ChatModel", "ChatResponse", "load_chat_model"]
