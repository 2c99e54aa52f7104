"""Adapter: any reasoning-gym dataset as a `Task` (and, through `openk2.rl.env.make_env`, an environment).

`get("rg:puzzle24")` builds `ReasoningGymTask("puzzle24")`. Difficulty levels come from the dataset's
reasoning-gym curriculum (level d sets every curriculum attribute to its (d-1)-th level, capped at its last);
datasets without a curriculum have one level. Keyword arguments override fields of the dataset's config.
Scoring is reasoning-gym's own `score_answer`, applied to the answer extracted by our convention.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from openk2.rl.tasks.base import Problem, Task, extract_answer


class ReasoningGymTask(Task):
    max_tokens = 2048

    def __init__(self, dataset: str, **config: Any):
        from reasoning_gym.factory import CURRICULA, DATASETS

        if dataset not in DATASETS:
            raise ValueError(f"unknown reasoning-gym dataset {dataset!r}; e.g. puzzle24, basic_arithmetic, sudoku")
        self.dataset, self.config = dataset, config
        self.name = f"rg:{dataset}"
        self._dataset_cls, self._config_cls = DATASETS[dataset]
        self._curriculum_cls = CURRICULA.get(dataset)
        attributes = self._curriculum_cls().attributes.values() if self._curriculum_cls else []
        self.num_difficulties = max((len(attr.levels) for attr in attributes), default=1)

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        difficulty = self._check_difficulty(difficulty)
        entry = self._make_dataset(seed, difficulty)[0]
        data = {"dataset": self.dataset, "entry": entry}
        return self._problem(entry["question"], data, seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        from reasoning_gym.factory import get_score_answer_fn

        answer = extract_answer(response_text, multiline=True)
        if answer is None:
            return 0.0
        score = get_score_answer_fn(problem.data["dataset"])(answer, problem.data["entry"])
        return float(min(max(score, 0.0), 1.0))

    def _make_dataset(self, seed: int, difficulty: int) -> Any:
        if self._curriculum_cls is not None:
            curriculum = self._curriculum_cls()
            curriculum.set_global_level(difficulty - 1)
            config = curriculum.generate_configuration({"seed": seed, "size": 1})
        else:
            config = self._config_cls(seed=seed, size=1)
        try:
            config = dataclasses.replace(config, **self.config)
        except TypeError as e:
            raise ValueError(f"bad config for reasoning-gym dataset {self.dataset!r}: {e}") from e
        if hasattr(config, "validate"):
            config.validate()
        return self._dataset_cls(config=config)
