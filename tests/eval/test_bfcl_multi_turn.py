"""BFCL multi-turn on the real bfcl-eval data and backends: gold replay passes every entry; a model that skips a
call, changes an argument, never calls, loops, or sends broken arguments fails with the matching reason; tool
results are fed back; runs are isolated from each other and from the sample's configuration."""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("bfcl_eval")

from openk2.eval import bfcl_official, registry  # noqa: E402
from openk2.eval.base import EvalContext, ScriptedChatModel  # noqa: E402
from openk2.eval.bfcl_multi_turn import (  # noqa: E402
    ADDED_FUNCTIONS_PROMPT,
    BFCLMultiTurnBenchmark,
    Environment,
    function_docs,
    parse_gold_call,
)
from openk2.eval.bfcl_schema import tools_for  # noqa: E402
from openk2.llm.base import ChatModel, ChatResponse  # noqa: E402

CTX = EvalContext(seed=1, max_tokens=64)


@pytest.fixture(scope="module")
def bench() -> BFCLMultiTurnBenchmark:
    return BFCLMultiTurnBenchmark()


@pytest.fixture(scope="module")
def entry0(bench):
    """multi_turn_base_0: turn 0 is cd/mkdir/mv (changes the file system), turn 1 cd + a read-only grep."""
    return bench.samples(limit=1)[0]


def turns_of(model: ScriptedChatModel) -> list[ChatResponse]:
    return list(model._turns)


def call(name: str, **args) -> dict:
    return {"id": f"x_{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


@pytest.mark.parametrize("category", ["base", "miss_func", "miss_param", "long_context"])
def test_oracle_passes_every_entry(category):
    bench = BFCLMultiTurnBenchmark(category)
    samples = bench.samples()
    name = "bfcl-multi-turn" + ("" if category == "base" else "-" + category.replace("_", "-"))
    assert len(samples) == 200 and registry.get(name).name == name
    verdicts = [(s.id, bench.evaluate(bench.oracle(s), s, CTX)) for s in samples]
    assert [(i, v.detail) for i, v in verdicts if v.score != 1.0 or not v.detail["diagnostic"]["valid"]] == []


def test_miss_func_adds_held_out_docs_at_their_turn():
    bench = BFCLMultiTurnBenchmark("miss_func")
    entry = bench.samples(limit=1)[0]  # 'sort' is held out until turn 3, whose user message is empty
    assert entry.data["missed_function"] == {"3": ["sort"]} and entry.data["turns"][3] == []
    seen: list[tuple[set, dict]] = []

    class Recording(ChatModel):
        def __init__(self, inner: ChatModel) -> None:
            self.inner = inner

        def chat(self, messages, tools=None, **sampling):
            seen.append(({t["function"]["name"] for t in tools}, dict(messages[-1])))
            return self.inner.chat(messages, tools, **sampling)

    assert bench.evaluate(Recording(bench.oracle(entry)), entry, CTX).score == 1.0
    assert all("sort" not in names for names, _ in seen[:5]) and "sort" in seen[5][0]
    assert seen[5][1] == {"role": "user", "content": ADDED_FUNCTIONS_PROMPT}


def test_gold_calls_parse_and_bind_to_keywords(entry0, bench):
    assert parse_gold_call("sort('final_report.pdf')") == ("sort", ("final_report.pdf",), {})
    assert parse_gold_call("mv(source='a', destination='b')") == ("mv", (), {"source": "a", "destination": "b"})
    with pytest.raises(ValueError, match="plain function call"):
        parse_gold_call("os.system('ls')")
    env = Environment(entry0.data["involved_classes"], entry0.data["initial_config"])
    assert env.keyword_arguments("sort", ("final_report.pdf",), {}) == {"file_name": "final_report.pdf"}
    # Public methods exist for the model (as in BFCL), private ones do not; errors come back as text.
    assert env.execute("_load_scenario", {}).startswith("Error during execution: no function")
    assert env.execute("cd", {}).startswith("Error during execution: ") and "folder" in env.execute("cd", {})
    assert json.loads(env.execute("ls", {})) == {"current_directory_content": ["document", "archive"]}


def test_skipped_state_change_fails_on_state(bench, entry0):
    turns = turns_of(bench.oracle(entry0))
    first = turns[0]
    assert [c["function"]["name"] for c in first.tool_calls] == ["cd", "mkdir", "mv"]
    turns[0] = ChatResponse(None, [c for c in first.tool_calls if c["function"]["name"] != "mkdir"], "tool_calls")
    verdict = bench.evaluate(ScriptedChatModel(turns), entry0, CTX)
    diagnostic = verdict.detail["diagnostic"]
    assert verdict.score == 0.0 and verdict.detail["error_type"] == "multi_turn:instance_state_mismatch"
    assert diagnostic["error_type"] == "state_mismatch" and diagnostic["turn"] == 0
    assert "GorillaFileSystem" in diagnostic["differences"]
    json.dumps({"answer": verdict.answer, "detail": verdict.detail})


def test_skipped_read_only_call_fails_on_results(bench, entry0):
    turns = turns_of(bench.oracle(entry0))
    second = turns[2]  # turn 1's calls: cd(temp) (private state only) and grep (read-only)
    assert [c["function"]["name"] for c in second.tool_calls] == ["cd", "grep"]
    turns[2] = ChatResponse(None, second.tool_calls[:1], "tool_calls")
    verdict = bench.evaluate(ScriptedChatModel(turns), entry0, CTX)
    diagnostic = verdict.detail["diagnostic"]
    assert verdict.detail["error_type"] == "multi_turn:execution_response_mismatch"
    assert diagnostic["error_type"] == "result_mismatch" and diagnostic["turn"] == 1
    assert verdict.score == 0.0 and diagnostic["missing_results"]


def test_wrong_argument_fails(bench, entry0):
    turns = turns_of(bench.oracle(entry0))
    turns[0] = ChatResponse(None, [call("cd", folder="document"), call("mkdir", dir_name="tmp"),
                                   call("mv", source="final_report.pdf", destination="tmp")], "tool_calls")
    verdict = bench.evaluate(ScriptedChatModel(turns), entry0, CTX)
    assert verdict.score == 0.0 and verdict.detail["diagnostic"]["error_type"] == "state_mismatch"
    assert verdict.detail["error_type"] == "multi_turn:instance_state_mismatch"


def test_text_only_and_broken_arguments_end_the_turn(bench, entry0):
    verdict = bench.evaluate(ScriptedChatModel(["I moved it."]), entry0, CTX)
    assert verdict.score == 0.0 and verdict.detail["error_type"] == "multi_turn:empty_turn_model_response"
    assert verdict.detail["diagnostic"]["error_type"] == "no_calls" and verdict.detail["diagnostic"]["turn"] == 0
    broken = {"id": "b", "type": "function", "function": {"name": "cd", "arguments": '{"folder": "doc'}}
    verdict = bench.evaluate(ScriptedChatModel([ChatResponse(None, [broken], "tool_calls")]), entry0, CTX)
    assert verdict.detail["diagnostic"]["error_type"] == "no_calls"
    assert verdict.answer[0] == [{"content": None, "undecodable": True}]


def test_step_limit(entry0):
    bench = BFCLMultiTurnBenchmark(max_steps_per_turn=3)
    looping = ScriptedChatModel([ChatResponse(None, [call("pwd")], "tool_calls")])
    verdict = bench.evaluate(looping, entry0, CTX)
    assert verdict.score == 0.0 and verdict.detail["error_type"] == "multi_turn:force_terminated"
    assert verdict.detail["diagnostic"]["error_type"] == "step_limit"
    assert len(verdict.answer) == 1 and len(verdict.answer[0]) == 3  # the entry ends at the forced quit
    assert all(step["results"] for step in verdict.answer[0])
    with pytest.raises(ValueError, match="max_steps_per_turn"):
        BFCLMultiTurnBenchmark(max_steps_per_turn=0)


def test_results_are_fed_back_and_runs_are_isolated(bench, entry0):
    """Also renders every prompt with K2's chat template, as a local model would (call ids, tool messages)."""
    from openk2.chat.template import render

    config = copy.deepcopy(entry0.data["initial_config"])
    seen: list[list[dict]] = []

    class Recording(ChatModel):
        def __init__(self, inner: ChatModel) -> None:
            self.inner = inner

        def chat(self, messages, tools=None, **sampling):
            seen.append([dict(m) for m in messages])
            assert {t["function"]["name"] for t in tools} >= {"cd", "mv", "grep", "post_tweet"}
            num_results = sum(m["role"] == "tool" for m in messages)
            assert render(messages, tools).count("## Return of ") == num_results  # ids verbatim, as the template does
            return self.inner.chat(messages, tools, **sampling)

    for _ in range(2):  # a second run starts from the initial state again
        assert bench.evaluate(Recording(bench.oracle(entry0)), entry0, CTX).score == 1.0
    assert entry0.data["initial_config"] == config
    after_first_calls = seen[1]
    tool_messages = [m for m in after_first_calls if m["role"] == "tool"]
    assert len(tool_messages) == 3 and after_first_calls[-4]["role"] == "assistant"
    assert all(m["tool_call_id"] == c["id"] for m, c in zip(tool_messages, after_first_calls[-4]["tool_calls"],
                                                          strict=True))
    assert after_first_calls[0]["role"] == "user"  # no system prompt, as BFCL's function-calling runner


def test_hostile_calls_never_reach_bfcls_eval(bench, entry0, tmp_path):
    """BFCL evaluates calls as Python strings: a call that names a builtin, or smuggles code in an argument
    name, must be neutralised before BFCL's checker sees it (it then fails as an unknown function would)."""
    target = tmp_path / "written"
    evil = [{"id": "e1", "type": "function", "function": {
                "name": "open", "arguments": json.dumps({"file": str(target), "mode": "w"})}},
            {"id": "e2", "type": "function", "function": {
                "name": "cd", "arguments": json.dumps({f"folder=open({str(target)!r},'w') or 1,x": "document"})}}]
    allowed = bfcl_official._public_methods(entry0.data["involved_classes"])
    assert "cd" in allowed and "open" not in allowed
    assert bfcl_official.safe_calls(evil, allowed) == [bfcl_official._UNSAFE_CALL] * 2
    turns = [ChatResponse(None, evil, "tool_calls"), *turns_of(bench.oracle(entry0))]
    verdict = bench.evaluate(ScriptedChatModel(turns), entry0, CTX)
    assert verdict.score == 1.0 and not target.exists()  # extra failing calls change nothing, and nothing ran
    assert bfcl_official.execution_strings([call("cd", folder="a'b")]) == ["cd(folder=\"a'b\")"]


def test_multi_turn_tools_are_valid_schemas():
    jsonschema = pytest.importorskip("jsonschema")
    classes = ["GorillaFileSystem", "MathAPI", "MessageAPI", "TwitterAPI", "TicketAPI", "TradingBot", "TravelAPI",
               "VehicleControlAPI"]
    tools, names = tools_for(function_docs(classes))
    assert len(tools) == len({t["function"]["name"] for t in tools}) >= 100
    for tool in tools:
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
