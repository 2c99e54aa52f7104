"""Tool-call parsers by name; a parser's module is imported only when it is asked for."""

from __future__ import annotations

import importlib

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


def list_tool_parsers() -> list[str]:
    """Names of the registered parsers, sorted."""
    return sorted(_REGISTRY)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under `name`; ValueError if there is none."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown tool parser {name!r}; registered: {', '.join(list_tool_parsers())}")
    module_name, class_name = _REGISTRY[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise TypeError(f"{module_name}.{class_name} is not a ToolParser")
    return cls
