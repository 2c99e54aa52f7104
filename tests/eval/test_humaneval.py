"""HumanEval: canonical solutions pass in the real sandbox, wrong ones fail, extraction is forgiving, and the
pass@k estimator matches brute-force enumeration of k-subsets."""

from __future__ import annotations

import itertools
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from openk2.eval.base import EvalContext, Sample, ScriptedChatModel
from openk2.eval.humaneval import HumanEvalBenchmark, build_program, extract_code, pass_at_k
from openk2.eval.registry import get
from openk2.llm.base import ChatModel, ChatResponse
from tests.infer import test_server as _srv

checkpoint = _srv.checkpoint  # a random tiny K2 with a trained tokenizer, shared with the server tests


@pytest.fixture(scope="module")
def bench():
    b = get("humaneval")
    yield b
    b.close()


def _evaluate_all(bench, samples, model_for, ctx=None):
    ctx = ctx or EvalContext()
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda s: bench.evaluate(model_for(s), s, ctx), samples))


def test_all_164_problems_load_in_file_order(bench):
    samples = bench.samples()
    assert len(samples) == 164
    assert [s.id for s in samples[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert samples[-1].id == "HumanEval/163"
    assert [s.id for s in bench.samples(3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


@pytest.mark.slow
def test_oracle_passes_all_164_and_the_first_ten_aggregate(bench):
    """Every canonical solution passes in the sandbox, and the first ten aggregate to 1.0 over n = 10 with a lower
    bound below 1 (one run of the 164 checks both)."""
    verdicts = _evaluate_all(bench, bench.samples(), bench.oracle)
    first_ten = verdicts[:10]
    assert [v.score for v in first_ten] == [1.0] * 10, [v.detail for v in first_ten]
    agg = bench.aggregate(first_ten)
    assert agg.value == 1.0 and agg.n == 10 and agg.low < 1.0
    failed = [(s.id, v.detail) for s, v in zip(bench.samples(), verdicts, strict=True) if v.score != 1.0]
    assert not failed


def test_wrong_solutions_score_zero_with_a_reason(bench):
    sample = bench.samples(1)[0]
    wrong = ScriptedChatModel(["```python\ndef has_close_elements(numbers, threshold):\n    return None\n```"])
    v = bench.evaluate(wrong, sample, EvalContext())
    assert v.score == 0.0 and v.detail["error"].startswith("test failed")
    prose = bench.evaluate(ScriptedChatModel(["I am not sure how to do this."]), sample, EvalContext())
    assert prose.score == 0.0 and "did not load" in prose.detail["error"]
    hang = ScriptedChatModel(["```python\ndef has_close_elements(numbers, threshold):\n    while True:\n"
                              "        pass\n```"])
    slow = HumanEvalBenchmark(timeout_s=2.0)
    v = slow.evaluate(hang, sample, EvalContext())
    slow.close()
    assert v.score == 0.0 and "killed" in v.detail["error"]


def test_extraction_cases():
    fn = "def add(a, b):\n    return a + b\n"
    assert extract_code(f"Sure!\n```python\n{fn}```\nDone.", "add") == fn
    assert extract_code(f"```\n{fn}```", "add") == fn  # no language tag
    # the block that defines the entry point wins over an earlier example block
    assert extract_code(f"```python\nprint(1)\n```\n```python\n{fn}```", "add") == fn
    assert extract_code(f"```python\n{fn}", "add") == fn  # unterminated fence (hit max_tokens)
    assert extract_code(fn, "add") == fn  # raw text
    assert extract_code("```text\nhello\n```", "add") == "```text\nhello\n```"  # non-Python block: raw text
    assert extract_code(None, "add") == ""


def test_build_program_full_function_body_and_flush_left_body():
    prompt = 'import math\n\n\ndef root(x):\n    """Square root."""\n'
    full = build_program(prompt, "def root(x):\n    return math.sqrt(x)\n", "root")
    body = build_program(prompt, "    return math.sqrt(x)\n", "root")
    flush = build_program(prompt, "return math.sqrt(x)\n", "root")
    for program in (full, body, flush):
        namespace: dict = {}
        exec(program, namespace)  # noqa: S102 - our own test strings
        assert namespace["root"](9.0) == 3.0
    assert full.startswith(prompt.rstrip())  # imports and helpers of the prompt stay available


def test_body_only_completion_passes(bench):
    sample = Sample("HumanEval/2", {})
    body = "    return number % 1.0\n"
    assert bench.evaluate(ScriptedChatModel([body]), sample, EvalContext()).score == 1.0


def test_pass_at_k_matches_brute_force():
    for n in range(1, 7):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert math.isclose(pass_at_k(n, c, k), brute, abs_tol=1e-12), (n, c, k)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


class _Alternating(ChatModel):
    """Returns n responses per call, alternating a correct and a wrong function (a deterministic fake)."""

    def __init__(self, good: str, bad: str) -> None:
        self.good, self.bad, self.calls = good, bad, []

    def chat(self, messages, tools=None, **sampling):
        self.calls.append(sampling)
        n = int(sampling.get("n", 1))
        return [ChatResponse(content=self.good if i % 2 == 0 else self.bad) for i in range(n)]


def test_pass_at_k_with_n_samples(bench):
    sample = Sample("HumanEval/2", {})
    good = "```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```"
    bad = "```python\ndef truncate_number(number: float) -> float:\n    return 0.5\n```"
    model = _Alternating(good, bad)
    ctx = EvalContext(samples_per_problem=4, k=2, temperature=0.8)
    v = bench.evaluate(model, sample, ctx)
    assert model.calls[0]["n"] == 4 and model.calls[0]["temperature"] == 0.8
    assert v.detail["passed"] == 2 and len(v.answer) == 4
    assert math.isclose(v.score, pass_at_k(4, 2, 2))  # 1 - C(2,2)/C(4,2) = 5/6
    agg = bench.aggregate([v, v])
    assert math.isclose(agg.value, 5 / 6) and bench.metric == "pass@2" and not bench.binary
    resumed = HumanEvalBenchmark()  # a resumed run aggregates stored verdicts without calling evaluate
    assert math.isclose(resumed.aggregate([v]).value, 5 / 6) and resumed.metric == "pass@2"
    with pytest.raises(ValueError, match="pass@k"):
        bench.evaluate(model, sample, EvalContext(samples_per_problem=2, k=3))


def test_a_backend_ignoring_n_is_called_again_with_new_seeds(bench):
    sample = Sample("HumanEval/2", {})
    single = ScriptedChatModel(["```python\ndef truncate_number(number):\n    return number % 1.0\n```"])
    seen = []
    original = single.chat

    def chat(messages, tools=None, **sampling):
        seen.append(sampling.get("seed"))
        return original(messages, tools, **{**sampling, "n": 1})

    single.chat = chat
    v = bench.evaluate(single, sample, EvalContext(samples_per_problem=3, k=1))
    assert v.score == 1.0 and len(v.answer) == 3 and len(set(seen)) == 3


def test_a_real_local_checkpoint_end_to_end(bench, checkpoint):
    """The tiny random K2 through `LocalChatModel`: its (garbage) completion runs in the sandbox and fails."""
    from openk2.llm.local import LocalChatModel

    model = LocalChatModel(checkpoint, max_seq_len=1024, device="cpu", dtype="float32")
    sample = bench.samples(1)[0]
    v = bench.evaluate(model, sample, EvalContext(max_tokens=8))
    assert v.score == 0.0 and isinstance(v.answer, str)
    assert v.detail["error"].startswith(("did not load", "test failed")), v.detail  # it reached the sandbox
