"""The harness on a toy benchmark: records, resume, settings guard, oracle path, errors, concurrency, tables, CLI."""

from __future__ import annotations

import json
import math
import threading

import pytest

from openk2.eval import registry
from openk2.eval.base import Benchmark, EvalContext, Sample, ScriptedChatModel, Verdict, mean_interval, wilson_interval
from openk2.eval.harness import compare, read_records, run_eval
from openk2.llm.base import ChatModel, ChatResponse


class Doubling(Benchmark):
    """'Double N' -> 2N. Samples 'boom' raise inside evaluate (a benchmark bug), 'nogold' have no oracle."""

    name = "toy-double"
    description = "double a number"

    def __init__(self, count: int = 10, extra: tuple[str, ...] = ()) -> None:
        self.count, self.extra = count, extra

    def samples(self, limit=None):
        items = [Sample(f"n{i}", {"n": i}) for i in range(self.count)] + [Sample(e, {"n": 0}) for e in self.extra]
        return items[:limit] if limit else items

    def evaluate(self, model, sample, ctx):
        if sample.id == "boom":
            raise RuntimeError("scorer bug")
        (reply,) = model.chat([{"role": "user", "content": f"Double {sample.data['n']}"}], **ctx.sampling(sample.id))
        ok = (reply.content or "").strip() == str(2 * sample.data["n"])
        return Verdict(float(ok), reply.content, {"expected": 2 * sample.data["n"]})

    def oracle(self, sample):
        if sample.id == "nogold":
            raise NotImplementedError("nothing to replay")
        return ScriptedChatModel([str(2 * sample.data["n"])])


class Counting(ChatModel):
    """Doubles correctly for even N, answers 0 otherwise; counts calls and records the seeds it saw."""

    name = "counting"

    def __init__(self) -> None:
        self.calls, self.seeds, self._lock = 0, {}, threading.Lock()

    def chat(self, messages, tools=None, **sampling):
        n = int(messages[-1]["content"].split()[-1])
        with self._lock:
            self.calls += 1
            self.seeds[n] = sampling["seed"]
        return [ChatResponse(str(2 * n if n % 2 == 0 else 0), finish_reason="stop")]


@pytest.fixture(autouse=True)
def toy_benchmarks():
    registry.register("toy-double", Doubling)
    yield
    registry._USER.clear()


def test_records_table_and_interval(tmp_path):
    model = Counting()
    results = run_eval(model, ["toy-double"], tmp_path, progress=False)
    agg = results["toy-double"]
    assert (agg.value, agg.n) == (0.5, 10)
    assert (agg.low, agg.high) == pytest.approx((wilson_interval(5, 10).low, wilson_interval(5, 10).high))
    records = read_records(tmp_path / "toy-double" / "samples.jsonl")
    assert [r["id"] for r in records] == [f"n{i}" for i in range(10)]
    assert records[3]["answer"] == "0" and records[3]["detail"] == {"expected": 6} and records[3]["score"] == 0.0
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["benchmarks"]["toy-double"]["value"] == 0.5 and payload["settings"]["model"] == "counting"
    assert "| toy-double | accuracy | 0.500 |" in (tmp_path / "summary.md").read_text()


def test_resume_scores_only_missing_and_ignores_cut_line(tmp_path):
    run_eval(Counting(), ["toy-double"], tmp_path, limit=4, progress=False)
    path = tmp_path / "toy-double" / "samples.jsonl"
    path.write_text(path.read_text() + '{"id": "n4", "sco')  # a crash mid-write
    model = Counting()
    results = run_eval(model, ["toy-double"], tmp_path, limit=6, progress=False)
    assert model.calls == 2 and results["toy-double"].n == 6  # n4 and n5 only
    ids = [r["id"] for r in read_records(path)]
    assert sorted(set(ids)) == [f"n{i}" for i in range(6)]


def test_refuses_to_mix_settings(tmp_path):
    run_eval(Counting(), ["toy-double"], tmp_path, limit=2, progress=False)
    with pytest.raises(ValueError, match="seed"):
        run_eval(Counting(), ["toy-double"], tmp_path, limit=2, ctx=EvalContext(seed=1), progress=False)


def test_seeds_depend_on_sample_not_order_or_concurrency(tmp_path):
    one, four = Counting(), Counting()
    a = run_eval(one, ["toy-double"], tmp_path / "a", progress=False)
    b = run_eval(four, ["toy-double"], tmp_path / "b", concurrency=4, progress=False)
    assert one.seeds == four.seeds and len(set(one.seeds.values())) == 10
    assert a["toy-double"] == b["toy-double"]
    other = Counting()
    run_eval(other, ["toy-double"], tmp_path / "c", ctx=EvalContext(seed=7), progress=False)
    assert other.seeds != one.seeds


def test_oracle_replays_gold(tmp_path):
    results = run_eval("oracle", ["toy-double"], tmp_path, progress=False)
    assert results["toy-double"].value == 1.0 and results["toy-double"].n == 10
    records = read_records(tmp_path / "toy-double" / "samples.jsonl")
    assert all(r["model"] == "oracle" and r["score"] == 1.0 for r in records)


def test_benchmark_bug_is_recorded_not_fatal(tmp_path, capsys):
    class Extra(Doubling):
        name = "toy-extra"

    registry.register("toy-extra", lambda: Extra(2, ("boom", "nogold")))
    results = run_eval("oracle", ["toy-extra"], tmp_path, progress=False)
    records = {r["id"]: r for r in read_records(tmp_path / "toy-extra" / "samples.jsonl")}
    assert records["boom"]["score"] == 0.0 and "RuntimeError: scorer bug" in records["boom"]["detail"]["error"]
    assert math.isnan(records["nogold"]["score"]) and "no oracle" in records["nogold"]["detail"]["error"]
    assert results["toy-extra"].n == 3 and results["toy-extra"].value == pytest.approx(2 / 3)
    assert "could not be scored: no oracle" in capsys.readouterr().out


def test_compare_side_by_side(tmp_path):
    run_eval(Counting(), ["toy-double"], tmp_path / "weak", progress=False)
    run_eval("oracle", ["toy-double"], tmp_path / "gold", progress=False)
    table = compare([tmp_path / "weak", tmp_path / "gold"], ["weak", "gold"])
    row = next(line for line in table.splitlines() if line.startswith("| toy-double"))
    assert "0.500" in row and "**1.000" in row and row.count("n=10") == 2
    with pytest.raises(ValueError, match="results.json"):
        compare([tmp_path / "nothing"])


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark"):
        run_eval(Counting(), ["no-such-bench"], tmp_path)
    with pytest.raises(ValueError, match="concurrency"):
        run_eval(Counting(), ["toy-double"], tmp_path, concurrency=0)


def test_intervals():
    assert wilson_interval(0, 10).low == 0.0 and wilson_interval(0, 10).high > 0.2
    assert wilson_interval(10, 10).high == 1.0 and wilson_interval(10, 10).low < 0.8
    agg = mean_interval([0.0, 1.0, 0.5, 0.5])
    assert agg.value == 0.5 and agg.low < 0.5 < agg.high


def test_cli_list_and_run(tmp_path, capsys):
    from openk2.cli import main

    assert main(["eval", "--list"]) == 0
    listed = capsys.readouterr().out
    for name in ("tau2-retail", "tau2-airline", "bfcl-simple", "bfcl-multiple", "bfcl-parallel", "bfcl-irrelevance",
                 "bfcl-multi-turn", "humaneval", "gsm-symbolic", "toy-double"):
        assert name in listed
    assert main(["eval", "--model", "oracle", "--benchmarks", "toy-double", "--out", str(tmp_path), "--quiet"]) == 0
    assert "| toy-double | accuracy | 1.000 |" in capsys.readouterr().out
    assert main(["eval", "compare", str(tmp_path)]) == 0
    assert main(["eval", "--model", "oracle", "--benchmarks", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_preflight_check_runs_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="judge"):
        run_eval("local:/no/such/checkpoint", ["rl:safety"], tmp_path)
    with pytest.raises(ValueError, match="pass@k"):
        run_eval("local:/no/such/checkpoint", ["humaneval"], tmp_path, ctx=EvalContext(samples_per_problem=2, k=3))


def test_rl_task_names_with_a_level():
    bench = registry.get("rl:arithmetic@3")
    assert bench.name == "rl:arithmetic@3" and bench.difficulty == 3
    assert registry.get("rl:arithmetic").difficulty is None
    with pytest.raises(ValueError, match="whole number"):
        registry.get("rl:arithmetic@x")


def test_unreachable_endpoint_is_not_scored_and_resumes(tmp_path):
    """A refused connection is not the model's wrong answer: nothing is recorded (so a rerun scores those
    samples) and the run stops early with a clear error, sequential or threaded."""
    import socket

    from openk2.llm.registry import load_chat_model

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = load_chat_model(f"openai:http://127.0.0.1:{port}/v1#none", max_retries=0, timeout=5)
    with pytest.raises(ValueError, match="could not be reached.*rerun"):
        run_eval(dead, ["toy-double"], tmp_path, progress=False)
    assert read_records(tmp_path / "toy-double" / "samples.jsonl") == []
    with pytest.raises(ValueError, match="could not be reached"):
        run_eval(dead, ["toy-double"], tmp_path / "threads", concurrency=3, progress=False)
    dead.close()
