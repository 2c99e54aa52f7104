"""The validator of simulated-user turns: a reply of the user simulator becomes a user message only if it passes.

Small models asked to role-play a user copy the prompt back (the CI-sized run of 2026-12-01: 147 of 204
openings held the answer template's "your next message"), leak chat-template tokens or role markers, or
ramble. `user_message_problem` says why a reply cannot be a user turn, or None when it can. It is pure: the
caller passes the prompt's fixed text as n-grams (`users.prompt_text()`, plus the episode's persona), never
the task's goal, which a user may legitimately restate.

Template echo is measured, not matched against one phrase: word 3-grams of the message that also occur in the
prompt's fixed text. A message is an echo when it *opens* with a 3-gram of the text that sits where the reply
goes or names it (an answer example, the "(The assistant is waiting. ...)" probes: the model continued the
template instead of speaking, "Your next message, please." under the CI run's prompt) or when at least half of
its words lie in 3-grams shared with any of the prompt's text, two or more of them ("... write only your next
message to the assistant in character ..."). One shared 3-gram elsewhere is allowed: "please put the total in
your next message" and "the goal is to book a table" are users talking.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

NGRAM = 3  # words per n-gram: "your next message" is the shortest copied phrase seen in the CI run
MAX_COVERAGE = 0.5  # share of a message's words inside shared n-grams at which it counts as copied
MAX_CHARS = 600  # twice the structured reply's 300-character message (users.USER_SCHEMA): a plain reply longer
# than this is not a user's turn

# The stable heads of the reasons below: the retry note shows one to the model, so they count as prompt text too.
REASON_HEADS = ("empty message", "control token in the message", "role marker in the message",
                "longer than the user turn budget", "opens with the simulator prompt's words",
                "mostly the simulator prompt's words", "ends the dialogue before it began")

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
# Chat-template control tokens of the families openk2 meets: ChatML/K2 `<|im_end|>`, DeepSeek's full-width
# `<｜end▁of▁sentence｜>`, Llama `[INST]`/`<<SYS>>`/`<s>`, tool and reasoning tags.
_CONTROL = re.compile(r"<\|[^|<>\n]{0,40}\|>|<｜[^｜\n]{0,40}｜>|\[/?INST\]|<</?SYS>>|</?s>|"
                      r"</?(?:think|tool_call|tool_response|function_call|im_start|im_end)>|\|(?:im_start|im_end)\|"
                      r"|<\|?endoftext\|?>", re.IGNORECASE)
# A line that names a speaker ("User: ...", "### Assistant:", "**System:**"): the model writing a dialogue, not a turn.
_ROLE = re.compile(r"^[ \t]*(?:#{1,6}[ \t]*|\*\*)?(?:system|user|assistant|human|ai)(?:\*\*)?[ \t]*(?:\*\*)?:",
                   re.IGNORECASE | re.MULTILINE)


def words(text: str) -> list[str]:
    """Lower-cased words of `text` (letters and digits; punctuation and JSON syntax dropped)."""
    return _WORD.findall(text.lower())


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """The word n-grams of `text`."""
    ws = words(text)
    return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)}


@dataclass(frozen=True)
class PromptGrams:
    """A prompt's fixed text as word n-grams: all of it, and the part a reply must not open with."""

    all: frozenset[tuple[str, ...]]
    openers: frozenset[tuple[str, ...]]

    def plus(self, pieces: Iterable[str]) -> PromptGrams:
        """These n-grams and those of more prompt `pieces` (not openers)."""
        return PromptGrams(self.all | frozenset(g for piece in pieces for g in ngrams(piece)), self.openers)


def prompt_grams(pieces: Iterable[str], openers: Iterable[str] = ()) -> PromptGrams:
    """The n-grams of each prompt piece (none spanning two pieces); `openers` are the pieces that sit where the
    reply goes (answer examples, probes) and count for both."""
    opener_set = frozenset(g for piece in openers for g in ngrams(piece))
    return PromptGrams(frozenset(g for piece in pieces for g in ngrams(piece)) | opener_set, opener_set)


def template_overlap(message: str, grams: PromptGrams, n: int = NGRAM) -> tuple[bool, float, int]:
    """(opens with an opener n-gram, share of words inside shared n-grams, number of shared n-gram positions)."""
    ws = words(message)
    if len(ws) < n:
        return False, 0.0, 0
    covered = [False] * len(ws)
    shared = 0
    for i in range(len(ws) - n + 1):
        if tuple(ws[i:i + n]) in grams.all:
            shared += 1
            covered[i:i + n] = [True] * n
    return tuple(ws[:n]) in grams.openers, sum(covered) / len(ws), shared


def user_message_problem(message: str, prompt: PromptGrams, *, max_chars: int = MAX_CHARS) -> str | None:
    """Why `message` cannot be a simulated user's turn (empty, control tokens, role markers, too long, an echo of
    the `prompt`), or None when it can; the reason's text before ';' is one of `REASON_HEADS`."""
    if not any(ch.isalnum() for ch in message):
        return "empty message"
    if (m := _CONTROL.search(message)) is not None:
        return f"control token in the message; {m.group(0)!r}"
    if (m := _ROLE.search(message)) is not None:
        return f"role marker in the message; {m.group(0).strip()!r}"
    if len(message) > max_chars:
        return f"longer than the user turn budget; {len(message)} > {max_chars} characters"
    opens, coverage, shared = template_overlap(message, prompt)
    if opens:
        return f"opens with the simulator prompt's words; {' '.join(words(message)[:NGRAM])!r}"
    if coverage >= MAX_COVERAGE and shared >= 2:
        return f"mostly the simulator prompt's words; {coverage:.0%} of words in shared {NGRAM}-grams"
    return None
