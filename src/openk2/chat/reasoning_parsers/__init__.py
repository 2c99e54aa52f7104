"""Reasoning parsers by name (`--reasoning-parser`); a parser's module is imported only when it is asked for."""

from __future__ import annotations

import importlib

from openk2.chat.reasoning_parsers.base import ReasoningDelta, ReasoningParser

__all__ = ["ReasoningDelta", "ReasoningParser", "get_reasoning_parser", "list_reasoning_parsers"]

# name -> (module, class). Every entry must have samples in tests/chat/test_reasoning_parsers.py.
_REGISTRY: dict[str, tuple[str, str]] = {
    "kimi_k2": ("openk2.chat.reasoning_parsers.kimi_k2", "KimiK2ReasoningParser"),
}


def list_reasoning_parsers() -> list[str]:
    """Names of the registered reasoning parsers, sorted."""
    return sorted(_REGISTRY)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The reasoning parser class registered under `name`; ValueError if there is none."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown reasoning parser {name!r}; registered: {', '.join(list_reasoning_parsers())}")
    module_name, class_name = _REGISTRY[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, ReasoningParser)):
        raise TypeError(f"{module_name}.{class_name} is not a ReasoningParser")
    return cls
