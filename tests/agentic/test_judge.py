"""The rubric judge: structured verdicts per criterion, mandatory items filter trajectories, statistics."""

from __future__ import annotations

import asyncio

from openk2.agentic.agents import Criterion, Rubric, Task
from openk2.agentic.jsonout import JSONStats
from openk2.agentic.judge import AcceptanceStats, Judgement, judge_trajectory
from openk2.agentic.rollout import Trajectory
from openk2.llm.base import ChatModel, ChatResponse
from tests.agentic.fake_models import ScriptedModel

TASK = Task("a0-t0", "a0", "simple", "What time is it in Paris?",
            Rubric(criteria=[Criterion("c1", "reports the current time in Paris", True),
                             Criterion("c2", "is polite", False)],
                   expected_tools=["get_current_time"], checkpoints=["time fetched"]))


def _trajectory(called=True, final="It is 10:00 in Paris.", end_reason="user_done"):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "time in Paris?"}]
    if called:
        messages += [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "type": "function",
             "function": {"name": "get_current_time", "arguments": '{"timezone": "Europe/Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c0", "content": '{"datetime": "10:00"}'}]
    if final:
        messages.append({"role": "assistant", "content": final})
    return Trajectory("a0-t0-s0", "a0-t0", "a0", messages, [], {"name": "p", "style": "s"}, end_reason)


def _judge(model, traj, stats=None):
    return asyncio.run(judge_trajectory(model, TASK, traj, stats=stats))


def test_good_trajectory_is_accepted():
    j = _judge(ScriptedModel(), _trajectory())
    assert j.accepted and j.failed_mandatory == [] and j.score == 1.0
    assert [v.criterion_id for v in j.verdicts] == ["final_answer", "no_agent_error", "expected_tools", "c1", "c2"]
    assert Judgement.from_dict(j.to_dict()) == j


def test_failing_a_mandatory_criterion_drops_the_trajectory():
    j = _judge(ScriptedModel(fail_criterion="c1"), _trajectory())
    assert not j.accepted and j.failed_mandatory == ["c1"]


def test_failing_an_optional_criterion_keeps_it():
    j = _judge(ScriptedModel(fail_criterion="c2"), _trajectory())
    assert j.accepted and j.score == 4 / 5


def test_rule_checks_override_a_lenient_judge():
    no_tool = _judge(ScriptedModel(), _trajectory(called=False))  # the judge passes everything; the rule does not
    assert not no_tool.accepted and no_tool.failed_mandatory == ["expected_tools"]
    no_answer = _judge(ScriptedModel(), _trajectory(final=None, end_reason="max_agent_steps"))
    assert not no_answer.accepted and "final_answer" in no_answer.failed_mandatory
    crashed = _judge(ScriptedModel(), _trajectory(end_reason="agent_error: RuntimeError: down"))
    assert "no_agent_error" in crashed.failed_mandatory


def test_unusable_judge_rejects_and_is_counted():
    class Rambler(ChatModel):
        def chat(self, messages, tools=None, **sampling):
            return [ChatResponse(content='{"verdicts": [{"id": "c1", "passed": "yes"}]}')]  # c2 missing, not bool

    stats = JSONStats()
    j = _judge(Rambler(), _trajectory(), stats)
    assert not j.accepted and j.failed_mandatory == ["judge"]
    assert stats.gave_up == 1 and stats.failures == {"invalid": 3}


def test_acceptance_stats():
    stats = AcceptanceStats()
    stats.add(_judge(ScriptedModel(), _trajectory()))
    stats.add(_judge(ScriptedModel(fail_criterion="c1"), _trajectory()))
    stats.add(_judge(ScriptedModel(fail_criterion="c1"), _trajectory(called=False)))
    assert stats.as_dict() == {"judged": 3, "accepted": 1, "rejected": 2, "acceptance_rate": 0.3333,
                               "rejections_by_item": {"c1": 1, "expected_tools": 1}}  # the third: the rule decided


def test_the_judge_model_is_not_asked_once_a_rule_has_rejected():
    class Unreachable(ChatModel):
        def chat(self, messages, tools=None, **sampling):
            raise AssertionError("the judge model was asked about a trajectory a rule had already rejected")

    stats = JSONStats()
    j = _judge(Unreachable(), _trajectory(called=False), stats)
    assert not j.accepted and j.model_skipped and j.failed_mandatory == ["expected_tools"]
    assert [v.by for v in j.verdicts] == ["rule"] * 3 and stats.requests == 0
    assert Judgement.from_dict(j.to_dict()) == j
    asked = asyncio.run(judge_trajectory(ScriptedModel(fail_criterion="c1"), TASK, _trajectory(called=False),
                                         ask_when_rejected=True))
    assert not asked.model_skipped and asked.failed_mandatory == ["expected_tools", "c1"]
    kept = _judge(ScriptedModel(), _trajectory())
    assert not kept.model_skipped and kept.accepted
