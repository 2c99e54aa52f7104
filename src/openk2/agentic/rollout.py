"""One episode (report 3.1.1, "Multi-turn Trajectories"): a simulated user, an agent model, simulated tools.

The user simulator opens with a request; the agent (any ChatModel, a strong remote model in real use) answers
or calls tools, which the tool simulator executes; after each final answer the user may follow up or end.
The episode stops when the user ends it, after `max_user_turns` user messages, after `max_agent_steps` agent
replies in total, or when a user turn used up its attempts (`user_rejected: REASON`: every reply of the user
simulator passes `user_check` first; an episode whose opening was never accepted has no dialogue). The result
is a `Trajectory`: OpenAI messages, the tools offered, how the episode ended, why user-simulator replies were
rejected (`user_rejections`), and `state`, the simulator's record: the world's final tables, what was created,
changed and deleted, the call log, and for coding episodes every sandboxed run (`ToolSimulator.record`). A
transport failure of any model (`openk2.llm.transport`) is not an ending: it is raised, and the episode is not
recorded.

`agent_tool_choice` decides how the agent's turns are decoded when the task expects tools: "auto" (the model
chooses), "required_first" (the first agent turn must call a declared tool, later turns "auto") or "required"
(every turn must call one until each expected tool has been called, then "auto"). With a grammar-constrained
backend (`hf:`, `local:`) a required turn is always a schema-valid call to a declared tool; which tool, and with
what arguments, is still the model's choice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from openk2.agentic.agents import Agent, Task
from openk2.agentic.simulate import ToolSimulator
from openk2.agentic.tools import Tool
from openk2.agentic.users import Persona, UserSimulator
from openk2.llm.base import ChatModel
from openk2.llm.transport import is_transport_error

AGENT_TOOL_CHOICES = ("auto", "required_first", "required")


@dataclass
class Trajectory:
    trajectory_id: str
    task_id: str
    agent_id: str
    messages: list[dict]
    tools: list[dict]
    persona: dict
    end_reason: str  # user_done | max_user_turns | max_agent_steps | agent_error: ... | user_rejected: ...
    state: dict = field(default_factory=dict)
    outcomes: dict = field(default_factory=dict)
    user_rejections: list[str] = field(default_factory=list)  # why each rejected user-simulator reply was rejected

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict) -> Trajectory:
        return cls(**record)

    def tool_calls(self) -> list[str]:
        """Names of the tools the agent called, in order."""
        return [c["function"]["name"] for m in self.messages if m["role"] == "assistant"
                for c in m.get("tool_calls") or []]


async def run_episode(trajectory_id: str, agent: Agent, task: Task, tools: list[Tool], agent_model: ChatModel,
                      user: UserSimulator, tool_sim: ToolSimulator, persona: Persona, *, max_user_turns: int = 3,
                      max_agent_steps: int = 8, agent_tool_choice: str = "auto", call_max_tokens: int | None = None,
                      **sampling: Any) -> Trajectory:
    """Play one episode and return its trajectory; a turn forced to be a tool call gets `call_max_tokens`
    (default: `sampling`'s max_tokens), since a call's JSON needs fewer tokens than a free answer."""
    if agent_tool_choice not in AGENT_TOOL_CHOICES:
        raise ValueError(f"agent_tool_choice must be one of {AGENT_TOOL_CHOICES}, got {agent_tool_choice!r}")
    specs = [t.to_openai() for t in tools]
    messages: list[dict] = [{"role": "system", "content": agent.system_prompt}]
    rejections: list[str] = []
    first = await user.next_turn(messages[1:])
    rejections += first.rejections
    if first.message is None:  # every opening the simulator wrote was rejected: no dialogue to play
        return _trajectory(trajectory_id, task, agent, messages, specs, persona, _gave_up(first.gave_up),
                           tool_sim, rejections)
    messages.append({"role": "user", "content": first.message})
    user_turns, agent_steps, end_reason = 1, 0, "max_agent_steps"
    while agent_steps < max_agent_steps:
        agent_steps += 1
        try:
            choice: dict[str, Any] = _tool_choice(agent_tool_choice, task, messages, agent_steps, bool(specs))
            if choice and call_max_tokens:
                choice["max_tokens"] = call_max_tokens
            reply = (await agent_model.achat(messages, tools=specs, **{**sampling, **choice}))[0]
        except Exception as err:  # noqa: BLE001 - one failed episode must not stop the run
            if is_transport_error(err):  # the endpoint is down: no episode, it stays pending
                raise
            end_reason = f"agent_error: {type(err).__name__}: {err}"[:200]
            break
        messages.append(_clean(reply.message()))
        if reply.tool_calls:
            for call in reply.tool_calls:
                result = await tool_sim.execute(call)
                # No `name`: K2's template heads a tool result with the role, naming the call by its id.
                messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result})
            continue
        if user_turns >= max_user_turns:
            end_reason = "max_user_turns"
            break
        follow_up = await user.next_turn(messages[1:])
        rejections += follow_up.rejections
        if follow_up.message is None:
            end_reason = "user_done" if follow_up.gave_up is None else _gave_up(follow_up.gave_up)
            break
        messages.append({"role": "user", "content": follow_up.message})
        user_turns += 1
    return _trajectory(trajectory_id, task, agent, messages, specs, persona, end_reason, tool_sim, rejections)


def _gave_up(reason: str | None) -> str:
    """The end reason of an episode whose user turn used up its attempts."""
    return f"user_rejected: {reason}"[:200]


def _trajectory(trajectory_id: str, task: Task, agent: Agent, messages: list[dict], specs: list[dict],
                persona: Persona, end_reason: str, tool_sim: ToolSimulator, rejections: list[str]) -> Trajectory:
    return Trajectory(trajectory_id=trajectory_id, task_id=task.task_id, agent_id=agent.agent_id,
                      messages=messages, tools=specs, persona=persona.to_dict(), end_reason=end_reason,
                      state=tool_sim.record(), outcomes=dict(tool_sim.outcomes), user_rejections=rejections)


def _tool_choice(mode: str, task: Task, messages: list[dict], step: int, have_tools: bool) -> dict[str, str]:
    """The `tool_choice` keyword for agent turn `step` (1-based): empty (the backend's "auto") or "required"."""
    expected = task.rubric.expected_tools
    if mode == "auto" or not expected or not have_tools:
        return {}
    if mode == "required_first":
        return {"tool_choice": "required"} if step == 1 else {}
    called = {c["function"]["name"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or []}
    return {"tool_choice": "required"} if any(n not in called for n in expected) else {}


def _clean(message: dict) -> dict:
    """An assistant message with only the fields the chat format knows (content as a string)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                             for c in message["tool_calls"]]
    return out
