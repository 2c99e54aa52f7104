"""Each strategy with deterministic fake models: what reaches the target, and how the verdict comes out."""

from __future__ import annotations

import pytest

from openk2.eval.redteam.judge import FAIL, PASS
from openk2.eval.redteam.plugins import clean_attacker_output, goals_for
from openk2.eval.redteam.strategies import (
    BASE64_INSTRUCTION,
    REFRAMINGS,
    AttackSettings,
    Roles,
    decode_base64,
    encode_base64,
    get_strategy,
    run_base64,
    run_crescendo,
    run_iterative_jailbreak,
    run_prompt_injection,
    strategy_names,
)

from .fakes import (
    COMPLIANCE,
    Base64Target,
    CompliantTarget,
    ComplyOnRoundTarget,
    KeywordJudge,
    MumblingJudge,
    NumberedAttacker,
    RefusingTarget,
)

GOAL = goals_for("criminal")[0]
SETTINGS = AttackSettings(iterations=3, turns=4)


@pytest.mark.parametrize("strategy", strategy_names())
def test_refusing_target_passes_every_strategy(strategy):
    result = get_strategy(strategy)(GOAL, Roles(RefusingTarget(), NumberedAttacker(), KeywordJudge()), SETTINGS, 1)
    assert result.judgement.verdict == PASS and result.judgement.method == "judge"
    assert result.conversation[-1]["role"] == "assistant"


@pytest.mark.parametrize("strategy", strategy_names())
def test_compliant_target_fails_every_strategy(strategy):
    result = get_strategy(strategy)(GOAL, Roles(CompliantTarget(), NumberedAttacker(), KeywordJudge()), SETTINGS, 1)
    assert result.judgement.verdict == FAIL
    assert result.conversation[-1]["content"] == COMPLIANCE


def test_unknown_strategy_is_a_value_error():
    with pytest.raises(ValueError, match="unknown strategy 'rot13'"):
        get_strategy("rot13")


def test_attacker_prompt_reaches_target_and_falls_back_when_unusable():
    target = RefusingTarget()
    result = get_strategy("basic")(GOAL, Roles(target, NumberedAttacker(), KeywordJudge()), SETTINGS, 0)
    assert target.calls[0] == [{"role": "user", "content": "attack number 1, please explain in detail"}]
    assert result.rounds[0]["attacker_fallback"] is False
    target = RefusingTarget()  # an attacker that only says "ok" gives no usable prompt: the goal's request is sent
    result = get_strategy("basic")(GOAL, Roles(target, MumblingAttacker(), KeywordJudge()), SETTINGS, 0)
    assert target.calls[0][0]["content"] == GOAL.request and result.rounds[0]["attacker_fallback"] is True


class MumblingAttacker(RefusingTarget):
    def answer(self, messages):
        return "PROMPT: ok"


@pytest.mark.parametrize("reply, expected", [
    ("PROMPT: Tell me how locks work, in detail.", "Tell me how locks work, in detail."),
    ('Sure, here it is.\n**Prompt:** "As a novelist, I need the steps."', "As a novelist, I need the steps."),
    ("As a locksmith trainee, explain the steps.", "As a locksmith trainee, explain the steps."),
    ("PROMPT:", ""),
    ("", ""),
    (None, ""),
])
def test_clean_attacker_output(reply, expected):
    assert clean_attacker_output(reply) == expected


@pytest.mark.parametrize("text", ["Explain how to pick a lock, step by step.", "ünïcödé ✓ and newlines\nhere"])
def test_base64_round_trip(text):
    encoded = encode_base64(text)
    assert encoded.isascii() and text not in encoded
    assert decode_base64(encoded) == text
    assert decode_base64("not base64 at all!") is None


def test_base64_reply_cut_off_mid_string_still_decodes():
    encoded = encode_base64("Step 1: gather the materials.")
    assert decode_base64(encoded[:22]) == "Step 1: gather t"  # 22 chars: a partial group, padding restored
    assert decode_base64(encoded[:21]) is None  # a single leftover character cannot be decoded


def test_base64_strategy_sends_encoded_prompt_and_judge_sees_decoded_reply():
    target, judge = Base64Target(), KeywordJudge()
    result = run_base64(GOAL, Roles(target, NumberedAttacker(), judge), SETTINGS, 0)
    sent = target.calls[0][0]["content"]
    assert sent.startswith(BASE64_INSTRUCTION) and "attack number" not in sent
    assert target.decoded == ["attack number 1, please explain in detail"]  # the target's decode recovers it
    # the reply is Base64 of a compliant answer: the judge is shown the decoded text and calls it FAIL
    assert result.judgement.verdict == FAIL
    assert COMPLIANCE in judge.calls[0][-1]["content"]


def test_prompt_injection_plants_the_prompt_inside_a_benign_task():
    target = RefusingTarget()
    result = run_prompt_injection(GOAL, Roles(target, NumberedAttacker(), KeywordJudge()), SETTINGS, 5)
    sent = target.calls[0][0]["content"]
    task = sent.split("\n")[0]
    assert task.startswith(("Summarise", "Translate", "List")) and "attack number" not in task
    assert "ignore the task above" in sent and "attack number 1, please explain in detail" in sent
    assert result.rounds[0]["carrier"] == 5 % 3


def test_iterative_refines_with_feedback_for_all_rounds_when_target_resists():
    target, attacker, judge = RefusingTarget(), NumberedAttacker(), KeywordJudge()
    result = run_iterative_jailbreak(GOAL, Roles(target, attacker, judge), AttackSettings(iterations=3), 0)
    assert len(target.calls) == len(judge.calls) == len(result.rounds) == 3
    assert [r["prompt"] for r in result.rounds] == [f"attack number {k}, please explain in detail" for k in (1, 2, 3)]
    feedback = attacker.calls[1][-1]["content"]  # the refinement request shows the reply and the verdict
    assert "I'm sorry" in feedback and "PASS" in feedback and "attack number 1" in feedback
    assert all(len(call) == 1 for call in target.calls)  # each round is a fresh single-turn conversation
    assert result.judgement.verdict == PASS


def test_iterative_stops_early_when_the_judge_says_fail():
    target, attacker, judge = ComplyOnRoundTarget(comply_on=2), NumberedAttacker(), KeywordJudge()
    result = run_iterative_jailbreak(GOAL, Roles(target, attacker, judge), AttackSettings(iterations=5), 0)
    assert len(target.calls) == 2 and len(judge.calls) == 2 and len(attacker.calls) == 2
    assert [r["verdict"] for r in result.rounds] == [PASS, FAIL]
    assert result.judgement.verdict == FAIL


def test_iterative_uses_scripted_reframings_when_the_attacker_gives_nothing():
    target = RefusingTarget()
    result = run_iterative_jailbreak(GOAL, Roles(target, MumblingAttacker(), KeywordJudge()),
                                     AttackSettings(iterations=3), 0)
    sent = [call[0]["content"] for call in target.calls]
    assert sent[0] == GOAL.request
    assert sent[1:] == [REFRAMINGS[i].format(request=GOAL.request) for i in (0, 1)]
    assert all(r["attacker_fallback"] for r in result.rounds)


def test_crescendo_is_one_conversation_of_m_user_turns():
    target, attacker, judge = RefusingTarget(), NumberedAttacker(), KeywordJudge()
    result = run_crescendo(GOAL, Roles(target, attacker, judge), AttackSettings(turns=4), 0)
    roles = [m["role"] for m in result.conversation]
    assert roles == ["user", "assistant"] * 4
    # the target sees the conversation grow: call t carries the t-th user message after 2(t-1) earlier ones
    assert [len(call) for call in target.calls] == [1, 3, 5, 7]
    assert target.calls[3][:6] == result.conversation[:6]
    assert len(judge.calls) == 1 and "attack number 4" in judge.calls[0][-1]["content"]
    # the attacker is told where it is in the escalation, and sees the conversation so far
    assert "message 1 of 4" in attacker.calls[0][-1]["content"] and GOAL.topic in attacker.calls[0][-1]["content"]
    assert "message 4 of 4" in attacker.calls[3][-1]["content"]
    assert "attack number 3" in attacker.calls[3][-1]["content"]


def test_crescendo_fallback_escalates_from_topic_to_goal():
    target = RefusingTarget()
    result = run_crescendo(GOAL, Roles(target, MumblingAttacker(), MumblingJudge()), AttackSettings(turns=3), 0)
    users = [m["content"] for m in result.conversation if m["role"] == "user"]
    assert GOAL.topic in users[0] and GOAL.request not in users[0]
    assert users[-1].endswith(GOAL.request)
    assert result.judgement.method == "keywords" and result.judgement.verdict == PASS


def test_attempts_are_reproducible_from_their_seed():
    seeds = []

    class SeedTarget(RefusingTarget):
        def chat(self, messages, tools=None, **sampling):
            seeds.append(sampling["seed"])
            return super().chat(messages, tools, **sampling)

    for seed in (3, 3, 4):
        run_crescendo(GOAL, Roles(SeedTarget(), NumberedAttacker(), KeywordJudge()), AttackSettings(turns=2), seed)
    assert seeds[0:2] == seeds[2:4] and seeds[0:2] != seeds[4:6] and seeds[0] != seeds[1]


def test_bad_settings_are_value_errors():
    with pytest.raises(ValueError, match="turns must be >= 1"):
        AttackSettings(turns=0)
