"""τ²-bench through tau2's own runner (orchestrator, LLMAgent, UserSimulator, evaluator, over litellm and real
HTTP) against a scripted endpoint: on the same trajectories it gives the same rewards as openk2's own loop."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tau2")
pytest.importorskip("litellm")
pytest.importorskip("pandas")

from openk2.eval.base import EvalContext  # noqa: E402
from openk2.eval.tau2 import Tau2Benchmark, opening_request  # noqa: E402
from openk2.eval.tau2_episode import GREETING, STOP  # noqa: E402
from openk2.eval.tau2_runner import Tau2RunnerBenchmark, trial_seeds  # noqa: E402
from openk2.llm.openai_backend import OpenAIChatModel  # noqa: E402
from tests.eval.scripted_endpoint import ScriptedEndpoint  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's pydantic schema notices
VARIANTS = ("gold", "silent", "idle")  # gold replay; gold calls without the facts; no action at all


@pytest.fixture(scope="module")
def dev() -> Tau2Benchmark:
    return Tau2Benchmark("retail")


@pytest.fixture(scope="module")
def tasks(dev):
    """Two test-split tasks with distinct openings and short gold replays (the endpoint tells them apart by
    what the user says first): one that must tell the customer facts (COMMUNICATE) and one that need not."""
    chosen, openings = {}, set()
    for sample in dev.samples():
        task = sample.data["task"]
        text, says = opening_request(task), bool(task["evaluation_criteria"].get("communicate_info"))
        if text in openings or len(task["evaluation_criteria"]["actions"]) > 6 or says in chosen:
            continue
        openings.add(text)
        chosen[says] = sample
        if len(chosen) == 2:
            break
    return {s.id: s for s in chosen.values()}


def _script(dev, sample, variant):
    turns = list(dev.oracle(sample)._turns)
    if variant == "silent":
        turns[-1] = type(turns[-1])(content="All done.", finish_reason="stop")
    if variant == "idle":
        turns = [type(turns[-1])(content="I am sorry, I cannot help with that.", finish_reason="stop")]
    return turns


@pytest.fixture(scope="module")
def endpoint(dev, tasks):
    """Model `user`: states the task's request, then stops. Model `agent-<variant>`: replays the variant's script
    for the task whose request opens the conversation, one turn per agent message so far."""
    def respond(request):
        messages = request["messages"]
        if request["model"] == "user":
            system = messages[0]["content"]
            [sample] = [s for s in tasks.values() if
                        s.data["task"]["user_scenario"]["instructions"]["reason_for_call"] in system]
            own_turns = sum(m["role"] == "assistant" for m in messages)  # the user's own words come back flipped
            return {"content": opening_request(sample.data["task"]) if own_turns == 0 else STOP}
        variant = request["model"].removeprefix("agent-")
        first = next(m["content"] for m in messages if m["role"] == "user")
        [sample] = [s for s in tasks.values() if opening_request(s.data["task"]) == first]
        done = sum(m["role"] == "assistant" and (bool(m.get("tool_calls")) or m.get("content") != GREETING)
                   for m in messages)
        turns = _script(dev, sample, variant)
        turn = turns[min(done, len(turns) - 1)]
        calls = [{"id": f"call_{done}_{j}", "type": "function", "function": c["function"]}
                 for j, c in enumerate(turn.tool_calls)]
        return {"content": turn.content, "tool_calls": calls}

    with ScriptedEndpoint(respond) as ep:
        yield ep


def _calls_and_results(messages):
    """(tool name, arguments) of every call and every tool result (as JSON where it parses), in order."""
    calls, results = [], []
    for m in messages:
        for c in m.get("tool_calls") or []:
            fn = c.get("function") or c
            args = fn["arguments"]
            calls.append((fn["name"], json.loads(args) if isinstance(args, str) else args))
        if m["role"] == "tool":
            try:
                results.append(json.loads(m["content"]))
            except (TypeError, json.JSONDecodeError):
                results.append(m["content"])
    return calls, results


def test_tau2_runner_matches_openk2_loop(dev, tasks, endpoint):
    runner = Tau2RunnerBenchmark("retail")
    user = OpenAIChatModel(endpoint.base_url, "user")
    ctx = EvalContext(user_model=user)
    rewards = {}
    for task_id, sample in tasks.items():
        for variant in VARIANTS:
            agent = OpenAIChatModel(endpoint.base_url, f"agent-{variant}")
            theirs = runner.evaluate(agent, runner.samples()[[s.id for s in runner.samples()].index(task_id)], ctx)
            ours = dev.evaluate(agent, sample, ctx)
            [trial] = theirs.detail["trials"]
            assert trial["termination"] == "user_stop" and ours.detail["termination"] == "user_stop"
            assert _calls_and_results(theirs.answer[0]) == _calls_and_results(ours.answer), (task_id, variant)
            assert theirs.score == ours.score == trial["reward"], (task_id, variant, theirs.detail, ours.detail)
            rewards[(task_id, variant)] = ours.score
    # both outcomes occur: gold passes everywhere, no action fails the DB check everywhere, and the gold calls
    # without the facts fail exactly where facts must be told (COMMUNICATE)
    assert all(rewards[(t, "gold")] == 1.0 and rewards[(t, "idle")] == 0.0 for t in tasks)
    says = {t: bool(s.data["task"]["evaluation_criteria"].get("communicate_info")) for t, s in tasks.items()}
    assert sorted(says.values()) == [False, True]
    assert all(rewards[(t, "silent")] == (0.0 if says[t] else 1.0) for t in tasks)
    assert any(r["tools"] for r in endpoint.requests if r["model"].startswith("agent"))


def test_trials_seeds_and_pass_hat_k(tasks, endpoint):
    runner = Tau2RunnerBenchmark("retail")
    task_id = next(iter(tasks))
    sample = next(s for s in runner.samples() if s.id == task_id)
    before = len(endpoint.requests)
    ctx = EvalContext(user_model=OpenAIChatModel(endpoint.base_url, "user"), samples_per_problem=2, k=2)
    verdict = runner.evaluate(OpenAIChatModel(endpoint.base_url, "agent-gold"), sample, ctx)
    assert [t["seed"] for t in verdict.detail["trials"]] == trial_seeds(300, 2)
    assert verdict.score == 1.0 and verdict.detail["pass_hat"] == {"1": 1.0, "2": 1.0}
    seeds = {r.get("seed") for r in endpoint.requests[before:]}
    assert seeds == set(trial_seeds(300, 2))  # each trial's seed reaches the endpoint, agent and user alike
    assert all(r.get("temperature") == 0.0 for r in endpoint.requests[before:])


def test_runner_needs_endpoints_and_a_user_model(endpoint):
    runner = Tau2RunnerBenchmark("retail")
    with pytest.raises(ValueError, match="needs --user-model"):
        runner.check(EvalContext())
    with pytest.raises(ValueError, match="k <= trials"):
        runner.check(EvalContext(user_model=object(), k=2))
    from openk2.eval.base import ScriptedChatModel

    with pytest.raises(ValueError, match="OpenAI-compatible endpoint"):
        runner.evaluate(ScriptedChatModel(["hi"]), runner.samples(1)[0],
                        EvalContext(user_model=OpenAIChatModel(endpoint.base_url, "user")))
    with pytest.raises(ValueError, match="unknown tau2 domain"):
        Tau2RunnerBenchmark("banking")


def test_telecom_runs_offline_with_user_tools(endpoint):
    """Telecom's user acts on a simulated phone with its own tools: tau2's runner offers them to the user model
    (tau2's Python device simulator, nothing remote) and the episode ends with a reward."""
    runner = Tau2RunnerBenchmark("telecom")
    sample = runner.samples(1)[0]
    before = len(endpoint.requests)

    def user_or_agent(request):  # the telecom user says one line and stops; the agent only talks
        return {"content": STOP if sum(m["role"] == "assistant" for m in request["messages"]) else "My phone "
                "has no service."} if request["model"] == "user" else {"content": "Please restart your phone."}

    endpoint.respond, respond = user_or_agent, endpoint.respond
    try:
        verdict = runner.evaluate(OpenAIChatModel(endpoint.base_url, "agent-x"), sample,
                                  EvalContext(user_model=OpenAIChatModel(endpoint.base_url, "user")))
    finally:
        endpoint.respond = respond
    [trial] = verdict.detail["trials"]
    assert trial["termination"] == "user_stop" and verdict.score == trial["reward"] == 0.0
    user_requests = [r for r in endpoint.requests[before:] if r["model"] == "user"]
    assert user_requests and {t["function"]["name"] for t in user_requests[0]["tools"]} >= {"toggle_airplane_mode"}
