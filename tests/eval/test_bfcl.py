"""BFCL single-turn categories on the real bfcl-eval data: gold replay scores 100% (but for four live entries
no answer can pass), each kind of wrong answer scores 0 with BFCL's reason and ours, every function doc becomes
a valid tool schema, and a real tiny model runs end to end."""

from __future__ import annotations

import json
import random
import re

import pytest

pytest.importorskip("bfcl_eval")

from openk2.eval import registry  # noqa: E402
from openk2.eval.base import EvalContext, Sample, ScriptedChatModel  # noqa: E402
from openk2.eval.bfcl import (  # noqa: E402
    CATEGORIES,
    BFCLBenchmark,
    check_calls,
    standardize,
    values_match,
)
from openk2.eval.bfcl_schema import tool_name, tools_for  # noqa: E402
from openk2.llm.base import ChatModel, ChatResponse  # noqa: E402
from tests.infer import test_server as _srv  # noqa: E402

CTX = EvalContext(seed=3, max_tokens=64)


def calls_model(*calls: tuple[str, object]) -> ScriptedChatModel:
    """A model that answers with these (name, arguments) tool calls; arguments given as a str are sent verbatim."""
    tool_calls = [{"id": f"c{i}", "type": "function",
                   "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}
                  for i, (name, args) in enumerate(calls)]
    return ScriptedChatModel([ChatResponse(content=None, tool_calls=tool_calls, finish_reason="tool_calls")])


def sample(category: str, sample_id: str) -> Sample:
    return next(s for s in BFCLBenchmark(category).samples() if s.id == sample_id)


# Live entries no answer can pass under BFCL's checker: a required parameter whose possible answers are empty
# (live_simple 106, 112), a gold parameter the doc does not declare (live_multiple 862) or a gold parameter
# other than the one the doc requires (live_multiple 964).
UNANSWERABLE = {"live_simple_106-63-0", "live_simple_112-68-0", "live_multiple_862-181-3", "live_multiple_964-207-0"}
SIZES = {"simple": 400, "irrelevance": 240, "live_simple": 258, "live_multiple": 1053, "live_parallel": 16,
         "live_parallel_multiple": 24, "live_irrelevance": 884, "live_relevance": 16}


@pytest.mark.parametrize("category", list(CATEGORIES))
def test_oracle_scores_every_sample(category):
    bench = BFCLBenchmark(category)
    samples = bench.samples()
    assert len(samples) == SIZES.get(category, 200)
    verdicts = {s.id: bench.evaluate(bench.oracle(s), s, CTX) for s in samples}
    failed = {i for i, v in verdicts.items() if v.score != 1.0}
    assert failed == {i for i in UNANSWERABLE if i.startswith(category + "_")}
    # our diagnostic agrees on gold, but for live_multiple_507's required '' (BFCL accepts it, we do not)
    disagree = {i for i, v in verdicts.items() if (v.score == 1.0) != v.detail["diagnostic"]["valid"]}
    assert disagree == ({"live_multiple_507-149-4"} if category == "live_multiple" else set())


def test_oracle_replies():
    (reply,) = BFCLBenchmark("simple").oracle(sample("simple", "simple_python_1")).chat([])
    assert reply.content is None and [c["function"] for c in reply.tool_calls] == [
        {"name": "math_factorial", "arguments": '{"number": 5}'}]
    # 'unit' is optional in the answer and not required by the doc: the oracle leaves it out.
    (reply,) = BFCLBenchmark("simple").oracle(sample("simple", "simple_python_0")).chat([])
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {"base": 10, "height": 5}
    irrelevance = BFCLBenchmark("irrelevance")
    (reply,) = irrelevance.oracle(irrelevance.samples(limit=1)[0]).chat([])
    assert reply.tool_calls == [] and reply.content


def test_names_registry_and_limits():
    for category in CATEGORIES:
        name = "bfcl-" + category.replace("_", "-")  # bfcl-live-simple, ...
        bench = registry.get(name)
        assert bench.name == name and bench.category == category and bench.description
    ids = [s.id for s in BFCLBenchmark("parallel").samples(limit=3)]
    assert ids == ["parallel_0", "parallel_1", "parallel_2"]
    with pytest.raises(ValueError, match="unknown BFCL category"):
        BFCLBenchmark("java")


@pytest.mark.parametrize(("calls", "official", "kind"), [
    ([("calculate_triangle_area", {"base": 10, "height": 5})], None, None),
    ([("calculate_triangle_area", {"base": 10.0, "height": 5})], "type_error:simple", "wrong_type"),  # not an int
    ([("calculate_triangle_area", {"base": "10", "height": 5})], "type_error:simple", "wrong_type"),
    ([("calculate_triangle_area", {"base": 10, "height": 6})], "value_error:others", "wrong_value"),
    ([("calculate_triangle_area", {"base": 10})], "simple_function_checker:missing_required", "missing_required"),
    ([("calculate_triangle_area", {"base": 10, "height": 5, "colour": "red"})],
     "simple_function_checker:unexpected_param", "unexpected_param"),
    ([("calculate_triangle_area", {"base": 10, "height": 5, "unit": "Units "})], None, None),  # normalised string
    ([("calculate_triangle_area", {"base": 10, "height": 5, "unit": "cm"})], "value_error:string", "wrong_value"),
    ([("triangle_area", {"base": 10, "height": 5})], "simple_function_checker:wrong_func_name", "wrong_function"),
    ([("calculate_triangle_area", {"base": 10, "height": 5})] * 2, "simple_function_checker:wrong_count",
     "wrong_count"),
    ([], "ast_decoder:decoder_failed", "wrong_count"),
    ([("calculate_triangle_area", '{"base": 10, "height": ')], "ast_decoder:decoder_failed", "bad_arguments"),
    ([("calculate_triangle_area", "[10, 5]")], "ast_decoder:decoder_wrong_output_format", "bad_arguments"),
])
def test_simple_wrong_answers_score_zero_with_reason(calls, official, kind):
    bench = BFCLBenchmark("simple")
    s = sample("simple", "simple_python_0")  # calculate_triangle_area(base=10, height=5, unit optional 'units')
    model = calls_model(*calls) if calls else ScriptedChatModel(["The area is 25."])
    verdict = bench.evaluate(model, s, CTX)
    assert verdict.score == (1.0 if official is None else 0.0)
    assert verdict.detail.get("error_type") == official  # BFCL's reason
    assert verdict.detail["diagnostic"]["error_type"] == kind and verdict.detail["diagnostic"]["valid"] == (
        kind is None)
    if official is not None:
        assert verdict.detail["error"] and verdict.detail["expected"] == s.data["ground_truth"]
    json.dumps({"answer": verdict.answer, "detail": verdict.detail})  # records must be JSON


def test_dotted_names_are_renamed_and_only_the_diagnostic_maps_them_back():
    bench = BFCLBenchmark("simple")
    s = sample("simple", "simple_python_1")  # math.factorial(number=5)
    seen = {}

    class Recording(ChatModel):
        def chat(self, messages, tools=None, **sampling):
            seen.update(messages=messages, tools=tools, sampling=sampling)
            return calls_model(("math_factorial", {"number": 5})).chat(messages)

    assert bench.evaluate(Recording(), s, CTX).score == 1.0
    assert [t["function"]["name"] for t in seen["tools"]] == ["math_factorial"]
    assert seen["tools"][0]["function"]["description"].endswith("Note that the provided function is in Python 3 "
                                                                 "syntax.")  # BFCL's runner hint
    # no system prompt: the sample's messages as they are, as BFCL's function-calling runner sends them
    assert [m["role"] for m in seen["messages"]] == ["user"] and "factorial" in seen["messages"][0]["content"]
    assert seen["sampling"] == CTX.sampling(s.id)
    # A model that echoes BFCL's dotted name fails BFCL's check (it was offered math_factorial); our diagnostic
    # maps the name back (a known difference). Another function fails both.
    dotted = bench.evaluate(calls_model(("math.factorial", {"number": 5})), s, CTX)
    assert dotted.score == 0.0 and dotted.detail["error_type"] == "simple_function_checker:wrong_func_name"
    assert dotted.detail["diagnostic"]["valid"] is True
    other = bench.evaluate(calls_model(("math_hypot", {"number": 5})), s, CTX)
    assert other.score == 0.0 and other.detail["diagnostic"]["error_type"] == "wrong_function"


def test_parallel_any_order_but_one_call_each():
    bench = BFCLBenchmark("parallel")
    s = sample("parallel", "parallel_0")
    gold = [c["function"] for c in bench.oracle(s).chat([])[0].tool_calls]
    assert len(gold) >= 2
    reordered = [(c["name"], c["arguments"]) for c in reversed(gold)]
    assert bench.evaluate(calls_model(*reordered), s, CTX).score == 1.0
    # The same correct call twice answers only one gold call.
    doubled = [(gold[0]["name"], gold[0]["arguments"])] * len(gold)
    verdict = bench.evaluate(calls_model(*doubled), s, CTX)
    assert verdict.score == 0.0 and verdict.detail["diagnostic"]["error_type"] == "wrong_value"
    assert verdict.detail["error_type"] == "parallel_function_checker_no_order:cannot_find_match"
    short = bench.evaluate(calls_model(*reordered[:-1]), s, CTX)
    assert short.detail["error_type"] == "parallel_function_checker_no_order:wrong_count"
    assert short.detail["diagnostic"]["error_type"] == "wrong_count"


def test_parallel_pairing_is_a_matching_not_greedy():
    # Call 0 fits both gold calls, call 1 only gold call 0: a greedy pass would give call 0 to gold 0 and fail.
    docs = [{"name": "f", "parameters": {"type": "dict", "properties": {"x": {"type": "integer"}},
                                         "required": []}}]
    gold = [{"f": {"x": [1, ""]}}, {"f": {"x": [2, ""]}}]
    assert check_calls(docs, [("f", {}), ("f", {"x": 1})], gold) is None
    assert check_calls(docs, [("f", {"x": 1}), ("f", {"x": 1})], gold).kind == "wrong_value"


def test_irrelevance_needs_no_call():
    bench = BFCLBenchmark("irrelevance")
    s = bench.samples(limit=1)[0]
    assert bench.evaluate(ScriptedChatModel(["I can't compute that with these tools."]), s, CTX).score == 1.0
    name = tool_name(s.data["functions"][0]["name"])
    verdict = bench.evaluate(calls_model((name, {})), s, CTX)
    assert verdict.score == 0.0 and verdict.detail["error_type"] == "irrelevance_error:decoder_success"
    assert verdict.detail["diagnostic"]["error_type"] == "irrelevance_call"
    assert verdict.answer["tool_calls"] == [{"name": name, "arguments": "{}"}]
    # a call whose arguments do not parse is no call to BFCL, a call to our diagnostic (a known difference)
    broken = bench.evaluate(calls_model((name, '{"x": ')), s, CTX)
    assert broken.score == 1.0 and broken.detail["diagnostic"]["error_type"] == "irrelevance_call"


def test_relevance_needs_a_call():
    bench = BFCLBenchmark("live_relevance")
    s = bench.samples(limit=1)[0]
    assert bench.evaluate(bench.oracle(s), s, CTX).score == 1.0
    verdict = bench.evaluate(ScriptedChatModel(["No."]), s, CTX)
    assert verdict.score == 0.0 and verdict.detail["error_type"] == "relevance_error:decoder_failed"
    assert verdict.detail["diagnostic"]["error_type"] == "no_call"


def test_value_rules():
    assert standardize("April 1, 2024") == standardize("april 1,2024") == "april12024"
    assert values_match(3, 3.0) and values_match(3.0, 3)  # int for float (the type check guards integers)
    assert not values_match(True, 1) and not values_match(1, True)  # booleans are not numbers
    assert values_match(["New York", "LA"], ["new york", "la"]) and not values_match(["LA"], ["la", "ny"])
    pattern = {"field": ["age"], "limit": [10, ""]}  # dict patterns map keys to alternatives, "" = optional
    assert values_match({"field": "Age"}, pattern) and values_match({"field": "age", "limit": 10}, pattern)
    assert not values_match({"field": "age", "limit": 11}, pattern) and not values_match({"limit": 10}, pattern)
    assert not values_match({"field": "age", "other": 1}, pattern)
    assert values_match([{"field": "age"}], [pattern]) and not values_match([], [pattern])
    # Arrays compare by value, as in BFCL (equal numbers pass whatever the item type); a non-array fails on type.
    docs = [{"name": "g", "parameters": {"type": "dict", "required": ["xs"], "properties": {
        "xs": {"type": "array", "items": {"type": "integer"}}}}}]
    assert check_calls(docs, [("g", {"xs": [1.0, 2]})], [{"g": {"xs": [[1, 2]]}}]) is None
    assert check_calls(docs, [("g", {"xs": ["1", 2]})], [{"g": {"xs": [[1, 2]]}}]).kind == "wrong_value"
    assert check_calls(docs, [("g", {"xs": "1, 2"})], [{"g": {"xs": [[1, 2]]}}]).kind == "wrong_type"
    # An empty list leaves an optional array out; a gold answer of another type (a variable name) is literal.
    assert check_calls(docs, [("g", {"xs": []})], [{"g": {"xs": [[1, 2], ""]}}]) is None
    assert check_calls(docs, [("g", {"xs": []})], [{"g": {"xs": [[1, 2]]}}]).kind == "wrong_value"
    assert check_calls(docs, [("g", {"xs": "data['x']"})], [{"g": {"xs": ["data['x']"]}}]) is None
    assert check_calls(docs, [("g", {"xs": "DATA['X']"})], [{"g": {"xs": ["data['x']"]}}]).kind == "wrong_value"


@pytest.mark.parametrize("category", list(CATEGORIES))
def test_every_function_doc_is_a_valid_tool(category):
    """Structural checks on every tool; the full Draft 2020-12 meta-schema check (slow: ~3 ms a schema) on a
    seeded sample of 40 per category."""
    legal = re.compile(r"[A-Za-z0-9_-]{1,64}")
    all_params = []
    for s in BFCLBenchmark(category).samples():
        tools, names = tools_for(s.data["functions"])
        assert {names[t["function"]["name"]] for t in tools} == {d["name"] for d in s.data["functions"]}
        for tool in tools:
            params = tool["function"]["parameters"]
            assert tool["type"] == "function" and legal.fullmatch(tool["function"]["name"])
            assert params["type"] == "object" and isinstance(params["properties"], dict)
            for schema in _all_schemas(params):
                assert schema.get("type") in (None, "object", "array", "string", "integer", "number", "boolean")
                assert "optional" not in schema and isinstance(schema.get("required", []), list)
            all_params.append(params)
    assert len(all_params) >= len(BFCLBenchmark(category).samples())
    jsonschema = pytest.importorskip("jsonschema")
    for params in random.Random(0).sample(all_params, min(40, len(all_params))):
        jsonschema.Draft202012Validator.check_schema(params)


def _all_schemas(schema: dict):
    yield schema
    for sub in schema.get("properties", {}).values():
        yield from _all_schemas(sub)
    if isinstance(schema.get("items"), dict):
        yield from _all_schemas(schema["items"])


checkpoint = _srv.checkpoint  # a random tiny K2 with a trained tokenizer, shared with the server tests


@pytest.fixture(scope="module")
def tiny_chat_model(checkpoint):
    from openk2.llm.local import LocalChatModel

    return LocalChatModel(checkpoint, max_seq_len=4096, device="cpu", dtype="float32")


@pytest.mark.slow
def test_real_tiny_model_end_to_end(tiny_chat_model):
    bench = registry.get("bfcl-simple")
    ctx = EvalContext(seed=0, max_tokens=24)
    for s in bench.samples(limit=3):
        verdict = bench.evaluate(tiny_chat_model, s, ctx)
        assert verdict.score in (0.0, 1.0)
        assert set(verdict.answer) == {"content", "tool_calls"}
        assert verdict.score == 1.0 or verdict.detail["error_type"].split(":")[0] in {
            "ast_decoder", "simple_function_checker", "type_error", "value_error"}
        assert verdict.detail["diagnostic"]["valid"] or verdict.detail["diagnostic"]["error_type"] in {
            "wrong_count", "wrong_function", "bad_arguments", "bad_call", "missing_required", "unexpected_param",
            "wrong_type", "wrong_value", "missing_param", "unpaired"}
        json.dumps({"id": s.id, "score": verdict.score, "answer": verdict.answer, "detail": verdict.detail})
