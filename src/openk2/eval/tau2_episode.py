"""One τ²-bench conversation: an agent `ChatModel` with tools, a simulated user, and a tau2 environment.

The turn order follows τ²-bench: the agent opens with a fixed greeting, then the user and the agent alternate.
An agent turn is either text for the user or tool calls; tool calls are executed at once (in order) and their
results go back to the agent, which moves again before the user does. The episode ends when

- the user's message contains ###STOP### (done), ###TRANSFER### (handed to a human) or ###OUT-OF-SCOPE###
  (the scenario cannot go on): a normal end, then scored (tau2: USER_STOP). The agent cannot end it (tau2's
  `LLMAgent.is_stop` is always false: an agent's "###STOP###" is text for the user);
- `max_steps` steps have passed (a user turn, an agent turn and the execution of one batch of tool calls each
  count one, as in tau2's orchestrator, which checks the limits only when the next message is not for the
  environment, so a batch of calls is always executed), or `max_errors` tool calls have failed, or a model sent
  an empty turn or could not take its input (e.g. a prompt longer than its context): an early end, scored 0.

The user sees only the text exchange, with roles flipped (the agent's words arrive as "user" messages), and is
prompted with the task's scenario; `ScriptedUser` replays fixed lines instead (the oracle's user).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from openk2.eval.tau2_env import run_tool_call
from openk2.llm.base import ChatModel, ChatResponse

GREETING = "Hi! How can I help you today?"
STOP, TRANSFER, OUT_OF_SCOPE = "###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###"
# termination reasons after which the episode is scored (tau2: USER_STOP); any other one scores 0
NORMAL_ENDS = frozenset({"user_stop", "transfer", "out_of_scope"})

USER_GUIDELINES = f"""You are role-playing a customer who writes to a customer service agent in a chat.
Play the customer described in the scenario below.
- Write only the customer's next message: short and natural, one message per turn.
- Give details only when the agent asks for them. Never invent facts the scenario does not give you.
- When your request is fully handled, or the agent cannot do it, reply with {STOP} alone.
- If the agent transfers you to a human agent, reply with {TRANSFER}.
- If the scenario does not tell you how to answer the agent, reply with {OUT_OF_SCOPE}."""


class User(Protocol):
    def reply(self, history: Sequence[dict]) -> str:
        """The user's next message given the conversation so far (agent's view, see `Episode.messages`)."""
        ...


def scenario_text(user_scenario: dict) -> str:
    """The task's user scenario (persona, reason for the call, what the user knows and how they behave) as text."""
    parts = []
    if user_scenario.get("persona"):
        parts.append(f"Persona:\n{user_scenario['persona']}")
    instructions = user_scenario.get("instructions") or ""
    if isinstance(instructions, str):
        parts.append(instructions)
    else:
        for key, label in (("reason_for_call", "Why you are writing"), ("known_info", "What you know"),
                           ("unknown_info", "What you do not know"), ("task_instructions", "How to behave")):
            value = (instructions.get(key) or "").strip()
            if value.strip("."):  # some tasks put a lone "." here
                parts.append(f"{label}:\n{value}")
    return "\n\n".join(parts)


class SimulatedUser:
    """A user played by a ChatModel, prompted with the guidelines and the task's scenario."""

    def __init__(self, model: ChatModel, user_scenario: dict, sampling: dict[str, Any]) -> None:
        self.model = model
        self.system = f"{USER_GUIDELINES}\n\n<scenario>\n{scenario_text(user_scenario)}\n</scenario>"
        self.sampling = sampling

    def reply(self, history: Sequence[dict]) -> str:
        flipped = [{"role": "system", "content": self.system}]
        for m in history:
            if m["role"] == "user":
                flipped.append({"role": "assistant", "content": m["content"]})
            elif m["role"] == "assistant" and not m.get("tool_calls") and m.get("content"):
                flipped.append({"role": "user", "content": m["content"]})
        [response] = self.model.chat(flipped, **{**self.sampling, "n": 1})
        return response.content or ""


class ScriptedUser:
    """A user who says fixed lines in order (the last one repeats)."""

    def __init__(self, lines: Sequence[str]) -> None:
        if not lines:
            raise ValueError("a scripted user needs at least one line")
        self.lines = list(lines)
        self._next = 0

    def reply(self, history: Sequence[dict]) -> str:
        line = self.lines[min(self._next, len(self.lines) - 1)]
        self._next += 1
        return line


@dataclass
class Episode:
    """A finished conversation. `messages` is the agent's view without the system prompt: the greeting, user
    turns, assistant turns (text or tool calls, with our own call ids) and tool results."""

    messages: list[dict]
    termination: str
    num_steps: int
    num_tool_calls: int
    num_tool_errors: int
    error: str | None = None

    @property
    def ended_normally(self) -> bool:
        return self.termination in NORMAL_ENDS


def _is_input_error(exc: Exception) -> bool:
    """A model that refused its input (ValueError from our backends, HTTP 400 from an endpoint, e.g. a prompt
    over the context length) ends the episode as that model's failure; anything else is an infrastructure error."""
    return isinstance(exc, ValueError) or getattr(exc, "status_code", None) == 400


def _user_end(text: str) -> str | None:
    for token, reason in ((STOP, "user_stop"), (TRANSFER, "transfer"), (OUT_OF_SCOPE, "out_of_scope")):
        if token in text:
            return reason
    return None


def _assistant_message(response: ChatResponse, turn: int) -> dict:
    """The agent's turn as a history message; its tool calls get ids of ours (unique, deterministic)."""
    message: dict[str, Any] = {"role": "assistant", "content": response.content}
    if response.tool_calls:
        calls = []
        for k, call in enumerate(response.tool_calls):
            function = dict(call.get("function") or {})
            if not isinstance(function.get("arguments"), str):
                function["arguments"] = json.dumps(function.get("arguments") or {}, default=str)
            calls.append({"id": f"call_{turn}_{k}", "type": "function", "function": function})
        message["tool_calls"] = calls
    return message


def run_episode(agent: ChatModel, user: User, env: Any, system_prompt: str, tools: list[dict],
                sampling: dict[str, Any], max_steps: int = 200, max_errors: int = 10) -> Episode:
    """Play one conversation to its end (see the module docstring for the rules)."""
    history: list[dict] = [{"role": "assistant", "content": GREETING}]
    steps = num_calls = num_errors = 0
    agent_turn = False

    def end(reason: str, error: str | None = None) -> Episode:
        return Episode(history, reason, steps, num_calls, num_errors, error)

    while True:
        if steps >= max_steps:
            return end("max_steps", f"no end after {max_steps} steps")
        if not agent_turn:
            try:
                text = user.reply(history)
            except Exception as exc:
                if not _is_input_error(exc):
                    raise
                return end("user_error", f"the user model failed: {exc}")
            steps += 1
            if not text.strip():
                return end("user_error", "the user sent an empty message")
            history.append({"role": "user", "content": text})
            reason = _user_end(text)
            if reason and steps >= max_steps:  # tau2 checks the step limit after the stop, and it wins
                return end("max_steps", f"the user stopped at the step limit ({max_steps})")
            if reason:
                return end(reason)
            agent_turn = True
            continue
        try:
            [response] = agent.chat([{"role": "system", "content": system_prompt}, *history], tools=tools,
                                    **{**sampling, "n": 1})
        except Exception as exc:
            if not _is_input_error(exc):
                raise
            return end("agent_error", f"the agent model failed: {exc}")
        steps += 1
        message = _assistant_message(response, steps)
        history.append(message)
        if message.get("tool_calls"):
            for call in message["tool_calls"]:
                result = run_tool_call(env, call)
                num_calls += 1
                num_errors += result.error
                history.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"].get("name") or "",
                                "content": result.content})
            steps += 1  # the environment's turn
            if num_errors >= max_errors:
                return end("too_many_errors", f"{num_errors} tool calls failed")
        elif not (response.content or "").strip():
            return end("agent_error", "the agent sent an empty message")
        else:
            agent_turn = False
