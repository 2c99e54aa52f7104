"""Reasoning parsers by name (`--reasoning-parser`); a parser's module is imported only when it is asked for."""

from __future__ import annotations

from openk2.chat.reasoning_parsers.base import ReasoningDelta, ReasoningParser
from openk2.chat.registry import LazyRegistry

__all__ = ["ReasoningDelta", "ReasoningParser", "get_reasoning_parser", "list_reasoning_parsers"]

# name -> (module, class). Every entry must have samples in tests/chat/test_reasoning_parsers.py.
_REGISTRY: dict[str, tuple[str, str]] = {
    "kimi_k2": ("openk2.chat.reasoning_parsers.kimi_k2", "KimiK2ReasoningParser"),
}


_PARSERS = LazyRegistry("reasoning parser", ReasoningParser, _REGISTRY)


def list_reasoning_parsers() -> list[str]:
    """Names of the registered reasoning parsers, sorted."""
    return _PARSERS.names()


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The reasoning parser class registered under `name`; ValueError if there is none."""
    return _PARSERS.get(name)
