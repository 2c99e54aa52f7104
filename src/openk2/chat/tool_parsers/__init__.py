"""Tool-call parsers by name; a parser's module is imported only when it is asked for."""

from __future__ import annotations

from openk2.chat.registry import LazyRegistry
from openk2.chat.tool_parsers.base import DeltaMessage, ParseResult, StreamAccumulator, ToolCall, ToolParser

__all__ = [
    "DeltaMessage",
    "ParseResult",
    "StreamAccumulator",
    "ToolCall",
    "ToolParser",
    "get_tool_parser",
    "list_tool_parsers",
]

# name -> (module, class). Every entry must have conformance samples in tests/chat/test_tool_parsers.py.
_REGISTRY: dict[str, tuple[str, str]] = {
    "kimi_k2": ("openk2.chat.tool_parsers.kimi_k2", "KimiK2ToolParser"),
}


_PARSERS = LazyRegistry("tool parser", ToolParser, _REGISTRY)


def list_tool_parsers() -> list[str]:
    """Names of the registered parsers, sorted."""
    return _PARSERS.names()


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under `name`; ValueError if there is none."""
    return _PARSERS.get(name)
