"""The K2 wire format: chat template, tool-call parsers (a lazy registry) and `ChatFormat`.

A foundation package: it imports nothing from openk2 but itself, so data, training, RL, serving and the
LLM backends can all share one format.
"""

from openk2.chat.format import AssistantMessage, ChatFormat, ChatFormatError, PreparedPrompt
from openk2.chat.template import DEFAULT_SYSTEM_PROMPT, parse_assistant, render, render_with_mask, tools_json
from openk2.chat.tool_parsers import get_tool_parser, list_tool_parsers

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "AssistantMessage",
    "ChatFormat",
    "ChatFormatError",
    "PreparedPrompt",
    "get_tool_parser",
    "list_tool_parsers",
    "parse_assistant",
    "render",
    "render_with_mask",
    "tools_json",
]
