"""Prices hidden behind a `lookup` tool: the answer cannot be guessed, only looked up (a multi-turn RL task).

Each episode's world is a seeded shop of `_SHOP_SIZE` items with prices 10..99, never shown in the prompt.

| level | question                                   | calls needed |
|-------|--------------------------------------------|--------------|
| 1     | 'In shop 4821, what does one "plum" cost?'                  | 1            |
| 2     | 'In shop 4821, what do one "plum" and one "fig" cost together?' | 2        |

The shop's number makes every prompt its own (held-out problems are shops never seen in training).

Items are quoted in the question as in the call's JSON arguments (`{"item": "plum"}`), so the BPE splits both
alike and the policy copies tokens rather than learning a mapping between two spellings.

The tool: `lookup(item)` -> "plum: 37", or an error for an item the shop does not sell. The reward is 1.0 iff
the final answer is the exact price (or sum) and every asked item was looked up in the episode (a lucky
guess without the tool earns nothing); `verify` alone checks the answer text only.
"""

from __future__ import annotations

import json
import random

from openk2.rl.tasks.arithmetic import parse_int
from openk2.rl.tasks.base import Problem, extract_answer
from openk2.rl.tasks.tool_task import ToolTask, ToolWorld

ITEMS = ("apple", "pear", "fig", "plum", "lime", "kiwi", "mango", "peach", "grape", "melon", "lemon", "cherry",
         "bread", "milk", "rice", "salt", "tea", "egg", "corn", "bean", "nut", "date", "yam", "leek")
_SHOP_SIZE = 6
_LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The price of an item in the shop.",
    "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}


class LookupWorld:
    """One episode's shop: the hidden prices, and the items looked up so far (the world's state)."""

    def __init__(self, prices: dict[str, int]) -> None:
        self.prices = dict(prices)
        self.looked_up: list[str] = []

    def call(self, name: str, arguments: dict) -> str:
        """Run `lookup(item=...)`; ValueError for another tool, other arguments or an unknown item."""
        if name != "lookup":
            raise ValueError(f"unknown tool {name!r}")
        if set(arguments) != {"item"} or not isinstance(arguments["item"], str):
            raise ValueError('lookup takes one string argument, "item"')
        item = arguments["item"].strip().lower()
        if item not in self.prices:
            raise ValueError(f"the shop sells no {item[:40]!r}")
        self.looked_up.append(item)
        return f"{item}: {self.prices[item]}"


class LookupTask(ToolTask):
    name = "lookup"
    num_difficulties = 2
    max_tokens = 64  # policy-sampled tokens per episode, over all its turns
    max_turns = 3

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        difficulty = self._check_difficulty(difficulty)
        rng = random.Random(f"{self.name}:{seed}:{difficulty}")
        number = rng.randrange(1000, 10_000)  # names the shop, so every problem's prompt is its own
        shop = rng.sample(ITEMS, _SHOP_SIZE)
        prices = {item: rng.randint(10, 99) for item in shop}
        asked = shop[:difficulty]
        if difficulty == 1:
            question = f'In shop {number}, what does one "{asked[0]}" cost? Look it up with the lookup tool.'
        else:
            question = (f'In shop {number}, what do one "{asked[0]}" and one "{asked[1]}" cost together? Look them '
                        "up with the lookup tool.")
        data = {"shop": number, "prices": prices, "asked": asked, "answer": sum(prices[a] for a in asked)}
        return self._problem(question, data, seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        answer = parse_int(extract_answer(response_text))
        return float(answer is not None and answer == problem.data["answer"])

    def tools(self) -> list[dict]:
        return [_LOOKUP]

    def world(self, problem: Problem) -> LookupWorld:
        return LookupWorld(problem.data["prices"])

    def verify_episode(self, problem: Problem, final_text: str, world: ToolWorld) -> float:
        looked_up = getattr(world, "looked_up", [])
        return self.verify(problem, final_text) * float(all(a in looked_up for a in problem.data["asked"]))

    def transcript(self, problem: Problem) -> list[dict]:
        asked, prices = problem.data["asked"], problem.data["prices"]
        calls = [{"id": f"functions.lookup:{i}", "type": "function",
                  "function": {"name": "lookup", "arguments": json.dumps({"item": a})}} for i, a in enumerate(asked)]
        results = [{"role": "tool", "tool_call_id": c["id"], "content": f"{a}: {prices[a]}"}
                   for c, a in zip(calls, asked, strict=True)]
        steps = "" if len(asked) == 1 else "+".join(str(prices[a]) for a in asked) + f"={problem.data['answer']}\n"
        return [{"role": "user", "content": problem.prompt}, {"role": "assistant", "content": "", "tool_calls": calls},
                *results, {"role": "assistant", "content": f"{steps}Answer: {problem.data['answer']}"}]


__all__ = ["ITEMS", "LookupTask", "LookupWorld"]
