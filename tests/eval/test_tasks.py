"""RL tasks as benchmarks: held-out seeds, replayed reference answers score 1, wrong answers 0, judges and
fractional rewards handled."""

from __future__ import annotations

import re

import pytest

from openk2.eval.base import EvalContext, ScriptedChatModel
from openk2.eval.registry import get
from openk2.eval.tasks import EVAL_SEED_BASE, TaskBenchmark
from openk2.llm.base import ChatModel, ChatResponse
from tests.infer import test_server as _srv

checkpoint = _srv.checkpoint  # a random tiny K2 with a trained tokenizer, shared with the server tests
CTX = EvalContext()


def _scores(bench, model_for, limit):
    return [bench.evaluate(model_for(s), s, CTX).score for s in bench.samples(limit)]


@pytest.mark.parametrize(("name", "limit"), [
    ("gsm-symbolic", 30), ("math", 30), ("instruction", 30), ("rl:arithmetic", 30), ("rl:game24", 20),
    ("rl:sudoku", 10), ("rl:cryptarithm", 20), ("rl:morse", 20), ("rl:tables", 20), ("rl:code", 3),
])
def test_oracle_scores_one_and_a_wrong_answer_zero(name, limit):
    bench = get(name)
    assert bench.name == name
    assert _scores(bench, bench.oracle, limit) == [1.0] * limit
    wrong = ScriptedChatModel(["I think it is this.\nAnswer: 987654321"])
    assert _scores(bench, lambda s: wrong, min(limit, 5)) == [0.0] * min(limit, 5)


def test_seeds_are_outside_every_rl_stream_and_samples_are_stable():
    bench = TaskBenchmark("arithmetic", "arith", num=40)
    samples = bench.samples()
    assert len(samples) == 40 and all(s.data["seed"] >= EVAL_SEED_BASE >= 2**31 for s in samples)
    assert [s.data["difficulty"] for s in samples[:6]] == [1, 2, 3, 4, 5, 1]  # levels in turn
    assert [s.id for s in TaskBenchmark("arithmetic", num=40).samples(5)] == [s.id for s in samples[:5]]
    prompts = [bench.problem(s).prompt for s in samples]
    assert len(set(prompts)) == len(prompts)  # distinct problems
    fixed = TaskBenchmark("arithmetic", difficulty=4, num=5)
    assert {s.data["difficulty"] for s in fixed.samples()} == {4} and fixed.name == "rl:arithmetic"


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="unknown RL task"):
        TaskBenchmark("no-such-task").samples(1)
    with pytest.raises(ValueError, match="difficulty"):
        TaskBenchmark("arithmetic", difficulty=9).samples(1)
    with pytest.raises(ValueError, match="num"):
        TaskBenchmark("arithmetic", num=0)


def test_gsm_symbolic_is_exact_match_although_reasoning_gym_gives_partial_credit():
    bench = get("gsm-symbolic")
    sample = bench.samples(1)[0]
    v = bench.evaluate(ScriptedChatModel(["Answer: 987654321"]), sample, CTX)
    assert v.score == 0.0 and v.detail["reward"] == pytest.approx(0.01) and bench.binary
    ok = bench.evaluate(bench.oracle(sample), sample, CTX)
    assert ok.score == 1.0 and str(ok.detail["expected"]) in ok.answer


def test_fractional_rewards_and_binary_flag():
    code = get("rl:code")
    assert not code.binary and code.metric == "mean reward"
    sample = code.samples(1)[0]
    # a function right on the empty list only: passes some of the six hidden tests
    partial = ScriptedChatModel(["Answer:\n```python\ndef sum_multiples(xs):\n    return 0\n```"])
    v = code.evaluate(partial, sample, CTX)
    assert 0.0 < v.score < 1.0
    agg = code.aggregate([v, v])
    assert agg.value == pytest.approx(v.score)
    assert get("math").binary and not get("rl:rg:basic_arithmetic").binary


def test_reasoning_gym_task_through_rl_prefix():
    bench = get("rl:rg:basic_arithmetic")
    assert _scores(bench, bench.oracle, 10) == [1.0] * 10


class _LiteralJudge(ChatModel):
    """Says YES iff the claim appears word for word in the context (a strict, deterministic judge)."""

    def chat(self, messages, tools=None, **sampling):
        text = messages[-1]["content"]
        context = re.search(r"Context:\n(.*?)\n\nClaim:", text, re.DOTALL).group(1)
        claim = re.search(r"Claim: (.*?)\n\n", text, re.DOTALL).group(1)
        return [ChatResponse(content="YES" if claim.strip() in context else "NO")]


def test_judged_tasks_need_a_judge_and_faithfulness_oracle_cites_the_context():
    bench = get("rl:faithfulness")
    samples = bench.samples(10)
    with pytest.raises(ValueError, match="judge"):
        bench.evaluate(bench.oracle(samples[0]), samples[0], CTX)
    ctx = EvalContext(judge=_LiteralJudge())
    assert [bench.evaluate(bench.oracle(s), s, ctx).score for s in samples] == [1.0] * 10
    made_up = ScriptedChatModel(["Answer: It lies on the Nile river and has a million residents."])
    assert bench.evaluate(made_up, samples[0], ctx).score == 0.0


def test_safety_has_no_oracle():
    bench = get("rl:safety")
    with pytest.raises(NotImplementedError, match="judged"):
        bench.oracle(bench.samples(1)[0])


def test_model_errors_score_zero_instead_of_raising():
    class Broken(ChatModel):
        def chat(self, messages, tools=None, **sampling):
            raise ConnectionError("endpoint down")

    bench = get("math")
    v = bench.evaluate(Broken(), bench.samples(1)[0], CTX)
    assert v.score == 0.0 and "endpoint down" in v.detail["error"]


def test_a_real_local_checkpoint_end_to_end(checkpoint):
    """The tiny random K2 through `LocalChatModel`: real prompts, real sampling, scored without errors."""
    from openk2.llm.local import LocalChatModel

    model = LocalChatModel(checkpoint, max_seq_len=512, device="cpu", dtype="float32")
    bench = get("rl:arithmetic")
    ctx = EvalContext(temperature=1.0, max_tokens=16, seed=3)
    samples = bench.samples(3)
    first = [bench.evaluate(model, s, ctx) for s in samples]
    again = [bench.evaluate(model, s, ctx) for s in samples]
    assert [v.answer for v in first] == [v.answer for v in again]  # per-sample seeds: reproducible
    assert all(isinstance(v.answer, str) and v.score in (0.0, 1.0) for v in first)
    assert all(v.detail["expected"] == bench.problem(s).data["answer"] for v, s in zip(first, samples, strict=True))
