"""Customer-service acts on the real tau2-bench retail database (a stateful multi-turn RL task, `ToolTask`).

Problems are drawn, seeded, from tau2's retail DB (`retail_db.py`: the real records and tau2's own tool functions,
a fresh database per episode, cut to the problem's customer). Two tools are declared, both tau2's:
`get_order_details(order_id)` and `cancel_pending_order(order_id, reason)`.

| level | question                                                      | the act | reward 1.0 iff                  |
|-------|---------------------------------------------------------------|---------|---------------------------------|
| 1     | 'What is the status of order #W2611340?'                      | a read  | the status, read in the episode |
| 2     | 'Cancel order #W4817420 with the reason "no longer needed".'  | a write | the DB equals the gold DB       |
| 3     | 'How many items does order #W2611340 contain?'                | a read  | the count, read in the episode  |

Level 2's orders are the 423 pending ones, and the reason is one of tau2's two valid ones. Its reward compares the
episode's final DB fingerprint with the gold one, from replaying the gold call on a fresh DB: answering without
acting leaves the DB pristine and scores 0, and so does cancelling the wrong order, giving the wrong reason or any
further write. The reads (levels 1 and 3) score only when `get_order_details` ran on the asked order in this
episode and the DB is unchanged (a policy that cancels the order it was asked about scores 0). `verify` alone sees
the answer text only: it grades a read's answer and gives a write 0, since only the DB can show a write.
"""

from __future__ import annotations

import json
import random

from openk2.rl.tasks.arithmetic import parse_int
from openk2.rl.tasks.base import Problem, extract_answer
from openk2.rl.tasks.retail_db import RetailWorld, customer_slice, records, tool_schemas
from openk2.rl.tasks.tool_task import ToolTask, ToolWorld

TOOLS = ("get_order_details", "cancel_pending_order")
REASONS = ("no longer needed", "ordered by mistake")  # tau2's cancel_pending_order accepts exactly these
_KINDS = {1: "status", 2: "cancel", 3: "count"}


class RetailTask(ToolTask):
    name = "retail"
    num_difficulties = 3
    max_tokens = 64  # policy-sampled tokens per episode, over all its turns
    max_turns = 3

    def __init__(self) -> None:
        self._orders: list[str] | None = None
        self._pending: list[str] | None = None
        self._schemas: list[dict] | None = None
        self._gold: dict[tuple, str] = {}  # (user, order, reason) -> the gold DB fingerprint

    def _order_ids(self, pending: bool) -> list[str]:
        if self._orders is None:
            orders = records()["orders"]
            self._orders = sorted(orders)
            self._pending = [o for o in self._orders if orders[o]["status"] == "pending"]
        return self._pending if pending else self._orders  # type: ignore[return-value]

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        difficulty = self._check_difficulty(difficulty)
        rng = random.Random(f"{self.name}:{seed}:{difficulty}")
        kind = _KINDS[difficulty]
        order_id = rng.choice(self._order_ids(pending=kind == "cancel"))
        order = records()["orders"][order_id]
        data = {"kind": kind, "order_id": order_id, "user_id": order["user_id"], "reason": None}
        if kind == "status":
            question = f"What is the status of order {order_id}? Look it up with get_order_details."
            data["answer"] = order["status"]
        elif kind == "count":
            question = f"How many items does order {order_id} contain? Look it up with get_order_details."
            data["answer"] = str(len(order["items"]))
        else:
            data["reason"] = rng.choice(REASONS)
            question = f'Cancel order {order_id} with the reason "{data["reason"]}", using cancel_pending_order.'
            data["answer"] = "cancelled"
        return self._problem(question, data, seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        """The answer text alone: a read's status or count; a write earns 0 (only the DB can show it)."""
        data = problem.data
        answer = extract_answer(response_text)
        if data["kind"] == "cancel" or answer is None:
            return 0.0
        if data["kind"] == "count":
            return float(parse_int(answer) == int(data["answer"]))
        return float(answer.strip().strip("'\"").lower() == data["answer"])

    def tools(self) -> list[dict]:
        if self._schemas is None:
            self._schemas = tool_schemas(TOOLS)
        return self._schemas

    def world(self, problem: Problem) -> RetailWorld:
        return RetailWorld(customer_slice(problem.data["user_id"]), self.tools())

    def gold_call(self, problem: Problem) -> tuple[str, dict]:
        """The one call a worked episode makes."""
        data = problem.data
        if data["kind"] == "cancel":
            return "cancel_pending_order", {"order_id": data["order_id"], "reason": data["reason"]}
        return "get_order_details", {"order_id": data["order_id"]}

    def gold_fingerprint(self, problem: Problem) -> str:
        """The DB fingerprint after the gold call on a fresh DB (a read leaves it pristine)."""
        data = problem.data
        key = (data["user_id"], data["order_id"], data["reason"])
        if key not in self._gold:
            world = self.world(problem)
            if data["kind"] == "cancel":
                world.call(*self.gold_call(problem))
            self._gold[key] = world.fingerprint()
        return self._gold[key]

    def verify_episode(self, problem: Problem, final_text: str, world: ToolWorld) -> float:
        if not isinstance(world, RetailWorld) or world.fingerprint() != self.gold_fingerprint(problem):
            return 0.0
        if problem.data["kind"] == "cancel":
            return 1.0  # the DB is the gold one: the cancel ran with the right order and reason, nothing else wrote
        read = ("get_order_details", {"order_id": problem.data["order_id"]}) in world.calls
        return self.verify(problem, final_text) * float(read)

    def transcript(self, problem: Problem) -> list[dict]:
        name, arguments = self.gold_call(problem)
        result = self.world(problem).call(name, arguments)  # the real tool's output on a fresh DB
        call_id = f"functions.{name}:0"
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        return [{"role": "user", "content": problem.prompt}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call_id, "content": result},
                {"role": "assistant", "content": f"Answer: {problem.data['answer']}"}]


__all__ = ["REASONS", "TOOLS", "RetailTask"]
