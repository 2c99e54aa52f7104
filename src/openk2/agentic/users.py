"""The user simulator (report 3.1.1: "LLM-generated personas with distinct styles engaging in multi-turn
dialogue"): a model plays a user who wants a task done, speaking in a persona's style.

The simulator sees the conversation from the user's side (the agent's turns arrive as the other party's
messages; tool traffic is hidden, as a real user would not see it) and either writes the next user message or
ends the dialogue once the goal is met or hopeless. The reply is structured (`USER_SCHEMA`: the message and a
`done` flag, decoded under the grammar by local backends); a backend that answers in plain text is read as the
message itself, ending with `END_TOKEN`.

Every reply is checked by `user_check.user_message_problem` against the prompt's fixed text (`prompt_text`):
an empty reply, an echo of the instructions, control tokens, role markers or a reply far over the turn budget is
rejected, shown to the model with its reason and retried, at most `max_attempts` calls per turn; `next_turn`
returns the reasons, and a turn that used up its attempts gives up (the episode then ends, `rollout.py`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from openk2.agentic.user_check import MAX_CHARS, REASON_HEADS, PromptGrams, prompt_grams, user_message_problem
from openk2.llm.base import ChatModel
from openk2.llm.structured import extract_json, json_schema_format

END_TOKEN = "[END]"
USER_SCHEMA = {"type": "object", "properties": {"message": {"type": "string", "maxLength": 300},
                                                "done": {"type": "boolean"}}, "required": ["message", "done"]}
# The prompt's fixed text (goal and persona are filled in per episode). It describes the answer in words: with an
# example value ('{"message": "your next message", ...}', the prompt of the CI-sized run of 2026-12-01) SmolLM2
# copied the example into 147 of 204 openings. The validator measures overlap with exactly these pieces.
REPLY_CUE = "the user's next message"  # what names the reply; a reply must not open with it
INSTRUCTIONS = ("You are role-playing a user of an AI assistant: a real person who wants the goal below done. Write, "
                f"in character, only {REPLY_CUE} to the assistant, revealing details as a real user would. Reply as "
                "JSON with the message text and a done flag; done is true only when the goal is achieved or the "
                f"assistant clearly cannot achieve it (in plain text: reply with exactly {END_TOKEN}).")
FIRST_PROBE = "(The assistant is waiting. Write your first message.)"
FOLLOW_PROBE = "(No reply yet. Continue or end.)"
RETRY_NOTE = "(That cannot be sent: {reason}. Write only what you, the user, say next, in your own words.)"
MAX_ATTEMPTS = 3  # model calls per user turn


def prompt_text() -> PromptGrams:
    """The user simulator prompt's fixed text as n-grams (what a reply must not copy): the instructions, the goal
    and persona labels, the retry note and its reasons; the reply's cue and the probes also must not open it."""
    return prompt_grams((INSTRUCTIONS, "Your goal:", "Persona:", "; style:", *RETRY_NOTE.split("{reason}"),
                         *REASON_HEADS), openers=(REPLY_CUE, FIRST_PROBE, FOLLOW_PROBE))


_PROMPT = prompt_text()


@dataclass(frozen=True)
class UserTurn:
    """One user turn: the message (None when the user ended the dialogue or gave up), why earlier replies were
    rejected, and `gave_up` (the last reason) when every attempt was rejected."""

    message: str | None
    rejections: tuple[str, ...] = ()
    gave_up: str | None = None


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
    """`await next_turn(conversation)` -> the user's next validated turn (`next_message`: its message only)."""

    def __init__(self, model: ChatModel, persona: Persona, goal: str, *, max_attempts: int = MAX_ATTEMPTS,
                 max_chars: int = MAX_CHARS, **sampling: Any) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.model = model
        self.persona = persona
        self.goal = goal
        self.max_attempts = max_attempts
        self.max_chars = max_chars
        self.sampling = sampling
        self._prompt = _PROMPT.plus((persona.name, persona.style))  # a reply reciting its persona is no turn either

    def _system(self) -> str:
        # What every episode shares comes first, then the task's goal, then the persona: concurrent episodes of
        # one task then share the longest prompt head (prefilled once by batching backends).
        return f"{INSTRUCTIONS}\nYour goal: {self.goal}\nPersona: {self.persona.name}; style: {self.persona.style}."

    def _view(self, conversation: Sequence[dict]) -> list[dict]:
        """The dialogue with roles swapped (the simulator is the 'assistant' writing user turns)."""
        view = [{"role": "system", "content": self._system()}]
        for msg in conversation:
            if msg["role"] == "user":
                view.append({"role": "assistant", "content": msg.get("content") or ""})
            elif msg["role"] == "assistant" and msg.get("content"):
                view.append({"role": "user", "content": msg["content"]})
        if len(view) == 1:
            view.append({"role": "user", "content": FIRST_PROBE})
        elif view[-1]["role"] == "assistant":  # our own turn last: ask for the follow-up explicitly
            view.append({"role": "user", "content": FOLLOW_PROBE})
        return view

    def _read(self, reply: str, first: bool) -> tuple[str | None, bool]:
        """(message, done) of one raw reply: structured JSON, else plain text ending with END_TOKEN."""
        try:
            value = extract_json(reply)
        except ValueError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("message"), str):
            if value["message"].strip() == END_TOKEN:  # the plain-text ending inside the JSON
                return None, not first
            message = value["message"].replace(END_TOKEN, "").strip()
            return message, value.get("done") is True and not first  # the first turn cannot end a dialogue
        text = reply.strip()
        if text.startswith(END_TOKEN) or text == END_TOKEN.strip("[]"):
            return None, not first
        return text.replace(END_TOKEN, "").strip(), False

    async def next_turn(self, conversation: Sequence[dict]) -> UserTurn:
        """The next user turn: a message that passed `user_message_problem`, the end of the dialogue, or giving
        up after `max_attempts` rejected replies (each reason kept, in order)."""
        view, rejections = self._view(conversation), []
        for _ in range(self.max_attempts):
            reply = (await self.model.achat(view, response_format=json_schema_format(USER_SCHEMA),
                                            **self.sampling))[0].content or ""
            message, done = self._read(reply, first=not conversation)
            if done:
                return UserTurn(None, tuple(rejections))
            problem = ("ends the dialogue before it began" if message is None else
                       user_message_problem(message, self._prompt, max_chars=self.max_chars))
            if problem is None:
                return UserTurn(message, tuple(rejections))
            rejections.append(problem)
            view = [*view, {"role": "assistant", "content": reply[:self.max_chars]},
                    {"role": "user", "content": RETRY_NOTE.format(reason=problem.split(";")[0])}]
        return UserTurn(None, tuple(rejections), gave_up=rejections[-1])

    async def next_message(self, conversation: Sequence[dict]) -> str | None:
        """The next user message, or None if the user ends the dialogue or every reply was rejected."""
        return (await self.next_turn(conversation)).message
