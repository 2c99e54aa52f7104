"""How often a model answers a tool-use prompt with a well-formed K2 tool call.

Each prompt is rendered with K2's chat template (its tools declared), the model continues it greedily with
the inference engine until `<|im_end|>`, and the output is parsed with K2's tool-call parser. A response is
well-formed when it holds at least one call, and every call names a declared tool and carries arguments
that are a JSON object with all of that tool's required keys. Also counted: responses with any call at all,
well-formed responses whose first call is the expected tool, and those whose arguments equal the expected ones.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from openk2.chat import ChatFormat, parse_assistant
from openk2.data.tokenizer import K2Tokenizer
from openk2.infer.engine import Engine
from openk2.infer.sampling import SamplingParams


@dataclass
class ToolCallScore:
    prompts: int
    any_call: int  # responses with at least one parsed call (well-formed or not)
    well_formed: int  # >= 1 call, every call to a declared tool with JSON-object arguments holding its required keys
    correct_tool: int  # well-formed and the first call is to the expected tool
    exact_arguments: int  # ... and its arguments equal the expected ones
    examples: list[str] = field(default_factory=list)  # the first few raw responses, for eyeballing
    prompt_tokens_median: float = 0.0  # prompt lengths (template, tool declarations and turns), in tokens
    prompt_tokens_max: int = 0

    @property
    def well_formed_rate(self) -> float:
        return self.well_formed / self.prompts if self.prompts else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "well_formed_rate": self.well_formed_rate}

    def summary(self) -> str:
        n = max(self.prompts, 1)
        return (f"well-formed {self.well_formed}/{self.prompts} ({self.well_formed / n:.1%}), any call "
                f"{self.any_call / n:.1%}, right tool {self.correct_tool / n:.1%}, "
                f"exact arguments {self.exact_arguments / n:.1%}")


def call_problem(call: dict, tools: Sequence[dict]) -> str | None:
    """Why a parsed call (OpenAI shape, from parse_assistant) is not well-formed for `tools`, or None."""
    if "error" in call:
        return call["error"]
    specs = {t["function"]["name"]: t["function"] for t in tools}
    name = call["function"]["name"]
    if name not in specs:
        return f"{name!r} is not a declared tool"
    arguments = json.loads(call["function"]["arguments"])  # the parser has checked it is a JSON object
    missing = [k for k in specs[name].get("parameters", {}).get("required", []) if k not in arguments]
    return f"missing required argument(s) {missing}" if missing else None


def score_response(text: str, tools: Sequence[dict], expected: dict | None = None) -> dict[str, bool]:
    """The score flags of one model output (the text after the generation prompt)."""
    _, calls = parse_assistant(text, tools=tools)
    well_formed = bool(calls) and all(call_problem(c, tools) is None for c in calls)
    right_tool = well_formed and expected is not None and calls[0]["function"]["name"] == expected["name"]
    exact = right_tool and json.loads(calls[0]["function"]["arguments"]) == expected["arguments"]
    return {"any_call": bool(calls), "well_formed": well_formed, "correct_tool": right_tool, "exact_arguments": exact}


@torch.no_grad()
def evaluate_tool_calls(model: torch.nn.Module, tokenizer: K2Tokenizer, prompts: Sequence[dict],
                        max_new_tokens: int = 64, batch_size: int = 16, keep_examples: int = 3) -> ToolCallScore:
    """Score greedy responses to `prompts` ({"messages", "tools", "expected"?}, as toolchat.heldout_prompts)."""
    if not prompts:
        raise ValueError("no prompts to evaluate")
    chat_format = ChatFormat(tokenizer)
    prepared = [chat_format.prepare(p["messages"], p.get("tools")) for p in prompts]
    ids = [p.token_ids for p in prepared]
    engine = Engine(model, tokenizer, max_batch_size=batch_size, max_seq_len=max(map(len, ids)) + max_new_tokens)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, stop_token_ids=prepared[0].stop_token_ids)
    results = engine.generate(ids, params)
    totals = dict.fromkeys(("any_call", "well_formed", "correct_tool", "exact_arguments"), 0)
    examples = []
    for prompt, result in zip(prompts, results, strict=True):
        text = tokenizer.decode(result.token_ids)
        flags = score_response(text, prompt.get("tools") or [], prompt.get("expected"))
        for key, hit in flags.items():
            totals[key] += int(hit)
        if len(examples) < keep_examples:
            examples.append(text)
    lengths = sorted(map(len, ids))
    median = (lengths[(len(lengths) - 1) // 2] + lengths[len(lengths) // 2]) / 2
    return ToolCallScore(prompts=len(prompts), examples=examples, prompt_tokens_median=median,
                         prompt_tokens_max=lengths[-1], **totals)
