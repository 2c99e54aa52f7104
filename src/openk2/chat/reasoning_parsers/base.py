"""The reasoning-parser interface: model output split into reasoning and content, incrementally.

A reasoning parser sits in front of the tool-call parser: it takes the raw output (after the generation
prompt) and says which text is the model's reasoning (returned as `reasoning_content`) and which is the
reply proper (content, in which the tool parser then looks for calls). As with tool parsers, subclasses
implement only `feed`/`finish`, and `parse` runs the same engine in one piece, so streaming and
non-streaming cannot disagree.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class ReasoningDelta:
    """What one `feed`/`finish` call made certain."""

    reasoning: str = ""
    content: str = ""

    def is_empty(self) -> bool:
        """Whether this delta carries nothing."""
        return not (self.reasoning or self.content)


class ReasoningParser(ABC):
    """Base class: subclasses implement `reset`, `feed` and `finish` (and take no constructor arguments)."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self.reset()

    @abstractmethod
    def reset(self) -> None:
        """Forget all state, ready for a new output."""

    @abstractmethod
    def feed(self, delta: str) -> ReasoningDelta:
        """Consume the next piece of model output; return what is now certain."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """End of output: flush held-back text."""

    def parse(self, text: str) -> ReasoningDelta:
        """Split a complete output (the streaming engine on a fresh parser, in one piece)."""
        parser = type(self)()
        first, last = parser.feed(text), parser.finish()
        return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)
