"""SFT conversations for the RL task: the RL warm-up's worked solutions, written as chat data.

K2 starts RL from its SFT model, and RL only sharpens what a policy can already sample. `openk2 rl` on its own
bridges that with a supervised warm-up of a fresh policy; in the pipeline the same worked solutions
(`openk2.rl.warmup.worked_solution`) go into the SFT mixture instead, so the SFT checkpoint already writes
`Answer: <n>`. The RL run's held-out problems are excluded, exactly as its warm-up excludes them.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from openk2.data.conversations import write_conversations
from openk2.rl import tasks
from openk2.rl.config import RLConfig
from openk2.rl.trainer import held_out_problems
from openk2.rl.warmup import problems, worked_solution


def write_task_conversations(path: str | Path, rl: RLConfig, count: int) -> Path:
    """Write `count` (user problem, assistant worked solution) conversations of `rl`'s task to `path` (JSONL)."""
    if rl.task.name != "arithmetic":
        raise ValueError(f"sft.task_examples needs worked solutions, which only the arithmetic task has "
                         f"(the RL task is {rl.task.name!r}); set sft.task_examples = 0")
    task = tasks.get(rl.task.name)
    seed = rl.train.seed
    held_out = {p.prompt for p in held_out_problems(task, rl.task.difficulties, rl.task.eval_problems,
                                                    rl.held_out_seed())}
    stream = problems(task, rl.task.difficulties, seed + 1, held_out)  # the warm-up's stream (warmup.py)
    conversations = [
        {"messages": [{"role": "user", "content": p.prompt},
                      {"role": "assistant", "content": worked_solution(p.data["expression"])}]}
        for p in itertools.islice(stream, count)
    ]
    return write_conversations(path, conversations)


__all__ = ["write_task_conversations"]
