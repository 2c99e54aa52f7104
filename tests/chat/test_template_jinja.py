"""Cross-check: `render` against jinja templates written here from the format's facts (not the shipped files),
rendered by transformers' own chat-template machinery (HF's jinja settings and `tojson`)."""

import pytest

from openk2.chat.pieces import sort_keys
from openk2.chat.template import render
from tests.chat.test_template import GOLDEN, THINKING

chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")

# Whitespace control: every tag strips around itself ({%- -%}), so only the literal strings below reach the output.
_HEADER = (
    "{%- set name = m.get('name') or m['role'] -%}"
    "{%- if m['role'] == 'user' -%}{{ '<|im_user|>' }}{%- elif m['role'] == 'assistant' -%}{{ '<|im_assistant|>' }}"
    "{%- else -%}{{ '<|im_system|>' }}{%- endif -%}{{ name ~ '<|im_middle|>' }}"
)
_CALLS = (
    "{{- '<|tool_calls_section_begin|>' -}}"
    "{%- for c in m['tool_calls'] -%}{{- '<|tool_call_begin|>' ~ c['id'] ~ '<|tool_call_argument_begin|>' -}}"
    "{%- if c['function']['arguments'] is string -%}{{- c['function']['arguments'] -}}"
    "{%- else -%}{{- c['function']['arguments'] | tojson -}}{%- endif -%}{{- '<|tool_call_end|>' -}}{%- endfor -%}"
    "{{- '<|tool_calls_section_end|>' -}}"
)
_PARTS = "{%- for p in c -%}{{- p['text'] -}}{%- endfor -%}"
_SYSTEM = "{{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' -}}"

INSTRUCT = (
    "{%- if tools -%}"
    "{{- '<|im_system|>tool_declare<|im_middle|>\\n  # Tools\\n  ' ~ (tools | tojson) ~ '<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- if messages[0]['role'] != 'system' -%}" + _SYSTEM + "{%- endif -%}"
    "{%- for m in messages -%}" + _HEADER
    + "{%- set c = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') -%}{%- if c -%}{{- c -}}{%- endif -%}" + _CALLS
    + "{%- elif m['role'] == 'tool' -%}{{- '## Return of ' ~ m['tool_call_id'] ~ '\\n    ' -}}{{- c -}}"
    "{%- elif c is string -%}{{- c -}}{%- elif c is not none -%}" + _PARTS + "{%- endif -%}"
    "{%- if add_generation_prompt or not loop.last -%}{{- '<|im_end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}"
)

_TEXT = "{%- set c = m.get('content') -%}{%- if c is string -%}{{- c -}}{%- elif c is not none -%}" + _PARTS + \
    "{%- endif -%}"
THINKING_TEMPLATE = (
    "{%- set last = namespace(i=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}"
    "{%- set last.i = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}{{- '<|im_system|>tool_declare<|im_middle|>' ~ (tools | tojson) ~ '<|im_end|>' -}}{%- endif -%}"
    "{%- if messages[0]['role'] != 'system' -%}" + _SYSTEM + "{%- endif -%}"
    "{%- for m in messages -%}" + _HEADER
    + "{%- if m['role'] == 'assistant' -%}"
    "{{- '<think>' -}}{%- if loop.index0 > last.i -%}{{- m.get('reasoning_content', '') -}}{%- endif -%}"
    "{{- '</think>' -}}" + _TEXT + "{%- if m.get('tool_calls') -%}" + _CALLS + "{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}{{- '## Return of ' ~ m['tool_call_id'] ~ '\\n' -}}" + _TEXT
    + "{%- else -%}" + _TEXT + "{%- endif -%}{{- '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}{%- endif -%}"
)


def hf_render(template: str, messages: list, tools: list | None, add_generation_prompt: bool) -> str:
    """`template` rendered by transformers as `apply_chat_template` does (after K2's deep sort of the tools)."""
    out, _ = chat_template_utils.render_jinja_template(
        conversations=[messages], tools=sort_keys(tools) if tools else None, chat_template=template,
        add_generation_prompt=add_generation_prompt)
    return out[0]


@pytest.mark.parametrize("shape", list(GOLDEN))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_instruct_agrees_with_jinja(shape, add_generation_prompt):
    messages, tools, _, _ = GOLDEN[shape]
    assert render(messages, tools, add_generation_prompt) == hf_render(INSTRUCT, messages, tools,
                                                                        add_generation_prompt)


@pytest.mark.parametrize("cut", range(1, len(THINKING) + 1))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_thinking_agrees_with_jinja(cut, add_generation_prompt):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = THINKING[:cut]
    assert render(messages, tools, add_generation_prompt, template="kimi_k2_thinking") == hf_render(
        THINKING_TEMPLATE, messages, tools, add_generation_prompt)
