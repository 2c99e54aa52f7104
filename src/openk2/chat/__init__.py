"""The K2 wire format: chat templates, tool-call and reasoning parsers (lazy registries), `ChatFormat`.

A foundation package: it imports nothing from openk2 but itself, so data, training, RL, serving and the
LLM backends can all share one format.
"""

from openk2.chat.encoding import encode_pieces
from openk2.chat.format import AssistantMessage, ChatFormat, ChatFormatError, PreparedPrompt, ReplyDelta
from openk2.chat.pieces import Piece
from openk2.chat.reasoning_parsers import get_reasoning_parser, list_reasoning_parsers
from openk2.chat.template import (
    DEFAULT_SYSTEM_PROMPT,
    TEMPLATES,
    parse_assistant,
    render,
    render_pieces,
    render_with_mask,
    tools_json,
)
from openk2.chat.tool_parsers import get_tool_parser, list_tool_parsers

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "TEMPLATES",
    "AssistantMessage",
    "ChatFormat",
    "ChatFormatError",
    "Piece",
    "PreparedPrompt",
    "ReplyDelta",
    "encode_pieces",
    "get_reasoning_parser",
    "get_tool_parser",
    "list_reasoning_parsers",
    "list_tool_parsers",
    "parse_assistant",
    "render",
    "render_pieces",
    "render_with_mask",
    "tools_json",
]
