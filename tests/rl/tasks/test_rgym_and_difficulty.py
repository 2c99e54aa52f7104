import pytest

from openk2.rl import tasks
from openk2.rl.tasks.arithmetic import ArithmeticTask
from openk2.rl.tasks.difficulty import PassEstimate, estimate_pass_rates, keep_moderate, pass_at_k
from tests.rl.tasks.fakes import FakeChat


@pytest.mark.parametrize("dataset", ["puzzle24", "basic_arithmetic"])
def test_reasoning_gym_adapter(dataset):
    task = tasks.get(f"rg:{dataset}")
    assert task.name == f"rg:{dataset}" and task.num_difficulties > 1  # both have curricula
    for difficulty, seed in [(1, 0), (1, 1), (task.num_difficulties, 0)]:  # puzzle24's generator is slowish
        problem = task.generate(seed, difficulty)
        entry = problem.data["entry"]
        assert entry["question"] in problem.prompt and problem.prompt.endswith(task.answer_instruction)
        assert task.verify(problem, f"Thinking...\nAnswer: {entry['answer']}") == 1.0
        assert task.verify(problem, "Answer: 1 + 1") < 0.5
        assert task.verify(problem, "no answer line") == 0.0
    assert task.generate(0, 1) == task.generate(0, 1)
    if dataset == "basic_arithmetic":
        easy, hard = task.generate(0, 1), task.generate(0, task.num_difficulties)
        assert len(hard.data["entry"]["question"]) > len(easy.data["entry"]["question"])


def test_reasoning_gym_errors():
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset"):
        tasks.get("rg:no_such_dataset")
    with pytest.raises(ValueError, match="bad config"):
        tasks.get("rg:basic_arithmetic", no_such_field=1).generate(0, 1)


def test_pass_at_k():
    assert pass_at_k(8, 0, 4) == 0.0 and pass_at_k(8, 8, 1) == 1.0 and pass_at_k(8, 5, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    assert PassEstimate(tasks.Problem("p"), 4, 2).pass_at_k(2) == pytest.approx(5 / 6)


def test_difficulty_filter_keeps_moderate_problems():
    task = ArithmeticTask()
    problems = [task.generate(seed, 2) for seed in range(12)]

    def model(prompt):
        # Always right on even answers; right on 3 of 8 samples for odd positive ones; never right otherwise.
        problem = next(p for p in problems if p.prompt == prompt)
        value = problem.data["answer"]
        if value % 2 == 0:
            return [f"Answer: {value}"] * 8
        if value > 0:
            return [f"Answer: {value}"] * 3 + ["Answer: 0.5"] * 5
        return ["Answer: 0.5"] * 8

    estimates = estimate_pass_rates(task, problems, FakeChat(model), num_samples=8)
    assert [e.num_samples for e in estimates] == [8] * 12
    kept = keep_moderate(estimates, low=0.1, high=0.9)
    expected = [p for p in problems if p.data["answer"] % 2 == 1 and p.data["answer"] > 0]
    assert kept == expected and kept
    assert all(e.rate == 3 / 8 for e in estimates if e.problem in kept)
    assert keep_moderate(estimates, low=0.5, high=0.9) == []
    with pytest.raises(ValueError):
        keep_moderate(estimates, low=0.9, high=0.1)
