"""The user simulator (report 3.1.1: "LLM-generated personas with distinct styles engaging in multi-turn
dialogue"): a model plays a user who wants a task done, speaking in a persona's style.

The simulator sees the conversation from the user's side (the agent's turns arrive as the other party's
messages; tool traffic is hidden, as a real user would not see it) and either writes the next user message or
ends the dialogue once the goal is met or hopeless. The reply is structured (`USER_SCHEMA`: the message and a
`done` flag, decoded under the grammar by local backends); a backend that answers in plain text is read as the
message itself, ending with `END_TOKEN`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from openk2.llm.base import ChatModel
from openk2.llm.structured import extract_json, json_schema_format

END_TOKEN = "[END]"
USER_SCHEMA = {"type": "object", "properties": {"message": {"type": "string", "maxLength": 300},
                                                "done": {"type": "boolean"}}, "required": ["message", "done"]}


@dataclass(frozen=True)
class Persona:
    name: str
    style: str

    def to_dict(self) -> dict:
        return asdict(self)


PERSONAS = (
    Persona("terse professional", "writes short, direct messages without pleasantries"),
    Persona("chatty novice", "is friendly, over-explains, is unsure of technical terms"),
    Persona("impatient manager", "wants results fast and pushes back on questions"),
    Persona("meticulous analyst", "gives exact numbers and asks for verification of every step"),
    Persona("non-native speaker", "writes simple, sometimes ungrammatical English"),
    Persona("indecisive customer", "changes one detail of the request midway through"),
)


def pick_persona(seed: int, episode_id: str, personas: Sequence[Persona] = PERSONAS) -> Persona:
    """The persona for an episode, deterministic in (seed, episode id)."""
    return random.Random(f"{seed}:persona:{episode_id}").choice(list(personas))


class UserSimulator:
    """`await next_message(conversation)` -> the user's next message, or None when the user is done."""

    def __init__(self, model: ChatModel, persona: Persona, goal: str, **sampling: Any) -> None:
        self.model = model
        self.persona = persona
        self.goal = goal
        self.sampling = sampling

    def _system(self) -> str:
        # What every episode shares comes first, then the task's goal, then the persona: concurrent episodes of
        # one task then share the longest prompt head (prefilled once by batching backends).
        return ("You are role-playing a user of an AI assistant. Write only your next message to the assistant, in "
                "character, revealing details as a real user would. Answer as JSON: "
                '{"message": "your next message", "done": false}. When the goal is achieved (or the assistant '
                f'clearly cannot achieve it), set "done": true (in plain text: reply with exactly {END_TOKEN}).\n'
                f"Your goal: {self.goal}\nPersona: {self.persona.name}; style: {self.persona.style}.")

    def _view(self, conversation: Sequence[dict]) -> list[dict]:
        """The dialogue with roles swapped (the simulator is the 'assistant' writing user turns)."""
        view = [{"role": "system", "content": self._system()}]
        for msg in conversation:
            if msg["role"] == "user":
                view.append({"role": "assistant", "content": msg.get("content") or ""})
            elif msg["role"] == "assistant" and msg.get("content"):
                view.append({"role": "user", "content": msg["content"]})
        if len(view) == 1:
            view.append({"role": "user", "content": "(The assistant is waiting. Write your first message.)"})
        elif view[-1]["role"] == "assistant":  # our own turn last: ask for the follow-up explicitly
            view.append({"role": "user", "content": "(No reply yet. Continue or end.)"})
        return view

    async def next_message(self, conversation: Sequence[dict]) -> str | None:
        """The next user turn, or None if the user ends the dialogue (or the model returns nothing)."""
        reply = (await self.model.achat(self._view(conversation), response_format=json_schema_format(USER_SCHEMA),
                                        **self.sampling))[0].content or ""
        try:
            value = extract_json(reply)
        except ValueError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("message"), str):
            message = value["message"].replace(END_TOKEN, "").strip()
            if value.get("done") is True and conversation:  # the first turn cannot end a dialogue
                return None
            return message or None
        text = reply.strip()
        if not text or text.startswith(END_TOKEN) or text == END_TOKEN.strip("[]"):
            return None
        return text.replace(END_TOKEN, "").strip() or None
