"""Complex instruction following: code-checked constraints, an LLM judge for the rest, and a hack check.

The graded text is everything after the last ``Answer:`` (reasoning may come first). Code-checked constraint
kinds: ``word_range`` (min..max words), ``include`` (keywords), ``exclude`` (a forbidden word), ``bullets``
(exactly n lines starting with ``* ``), ``lowercase``, ``title`` (a ``<<title>>``), ``end_with`` (an exact
closing phrase). With a judge, difficulty >= 3 adds one ``judged`` constraint (a tone or style), asked of the
judge as a yes/no question.

Hack check (report 3.2.1): a response must not *claim* compliance it lacks. Sentences that talk about the
constraints ("Word count: 50", "I have included the word X", "all requirements are met") are removed before
any check, so a claim cannot make a keyword appear or persuade the judge; and a numeric claim (word or bullet
count) that is false is a hack in itself. A hacked response scores 0. The reward is 1.0 iff every constraint
holds and there is no hack.
"""

from __future__ import annotations

import random
import re
from typing import Any

from openk2.llm.base import ChatModel
from openk2.rl.tasks.base import Problem, Task, extract_answer
from openk2.rl.tasks.judge import ask_yes_no

_TOPICS = ("autumn in the city", "learning to cook", "a trip to the sea", "caring for houseplants", "morning routines",
           "public libraries", "riding a bicycle", "the night sky", "baking bread", "a rainy weekend")
_KEYWORDS = ("lantern", "harbor", "velvet", "compass", "meadow", "copper", "whistle", "orchard", "granite", "ribbon")
_FORBIDDEN = ("very", "really", "just", "thing", "stuff", "nice")
_ENDINGS = ("that is all for today.", "thanks for reading.", "until next time.")
_TONES = ("Write in a cheerful, upbeat tone.", "Write in a formal, businesslike tone.",
          "Write as if explaining to a five-year-old.")
_FILLER = ("and", "then", "we", "saw", "many", "bright", "small", "calm", "days", "with", "friends", "under", "open",
           "skies", "while", "walking", "slowly", "home")
_CODE_KINDS = ("word_range", "include", "exclude", "bullets", "lowercase", "title", "end_with")

_WORD_RE = re.compile(r"[A-Za-z0-9']+")
_BULLET_RE = re.compile(r"^\s*[*-] ", re.MULTILINE)
# Sentences about the response's own compliance: removed before checking (see the module docstring).
_CLAIM_RE = re.compile(
    r"word count|\bwords?\s*[:=]\s*\d+|\(\s*\d+\s+words?\s*\)|\b\d+\s+bullet"
    r"|\b(?:i|we)\s+(?:have\s+|'ve\s+)?(?:used|included|mentioned|incorporated|avoided|kept|written|followed)\b"
    r"|\b(?:constraints?|requirements?|instructions?|rules?)\b.*\b(?:met|satisfied|followed|fulfilled)\b"
    r"|\b(?:this|the)\s+(?:response|note|text|answer)\s+(?:is|was|has|contains|includes|uses|satisfies|meets)\b"
    r"|[✅✓]", re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"(?<=[.!?\n])")
_CLAIMED_WORDS_RE = re.compile(r"(?:word count\s*(?:is|:|=)?\s*|\(\s*)(\d+)(?:\s+words?)?", re.IGNORECASE)
_CLAIMED_BULLETS_RE = re.compile(r"\b(\d+)\s+bullet", re.IGNORECASE)


class InstructionTask(Task):
    name = "instruction"
    num_difficulties = 5
    max_tokens = 1024
    answer_instruction = 'End your response with a line "Answer:" followed by the note itself.'

    def __init__(self, judge: ChatModel | None = None, judge_max_tokens: int = 256):
        self.judge, self.judge_max_tokens = judge, judge_max_tokens

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        difficulty = self._check_difficulty(difficulty)
        rng = random.Random(f"{self.name}:{seed}:{difficulty}")
        topic = rng.choice(_TOPICS)
        constraints = [_random_constraint(rng, kind) for kind in rng.sample(_CODE_KINDS, difficulty)]
        if self.judge is not None and difficulty >= 3:
            constraints.append({"kind": "judged", "text": rng.choice(_TONES)})
        rules = "\n".join(f"- {describe(c)}" for c in constraints)
        prompt = f"Write a short note about {topic}. Follow every rule:\n{rules}"
        return self._problem(prompt, {"topic": topic, "constraints": constraints}, seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        text = extract_answer(response_text, multiline=True)
        if text is None or hack_check(text, problem.data["constraints"]):
            return 0.0
        body = strip_claims(text)
        for constraint in problem.data["constraints"]:
            if constraint["kind"] == "judged":
                if self.judge is None:
                    raise ValueError("this problem has a judged constraint: build the task with judge=<ChatModel>")
                if not _judge_constraint(self.judge, constraint["text"], body, self.judge_max_tokens):
                    return 0.0
            elif not check(constraint, body):
                return 0.0
        return 1.0


def describe(constraint: dict[str, Any]) -> str:
    """The constraint as an instruction for the prompt."""
    kind = constraint["kind"]
    return {
        "word_range": lambda c: f"Use between {c['min']} and {c['max']} words.",
        "include": lambda c: "Include the words " + " and ".join(f"'{w}'" for w in c["words"]) + ".",
        "exclude": lambda c: f"Do not use the word '{c['word']}'.",
        "bullets": lambda c: f"Use exactly {c['count']} bullet points, each a line starting with '* '.",
        "lowercase": lambda c: "Write only lowercase letters.",
        "title": lambda c: "Start with a title wrapped in double angle brackets, like <<my title>>.",
        "end_with": lambda c: f"End with the exact phrase '{c['phrase']}'",
        "judged": lambda c: c["text"],
    }[kind](constraint)


def check(constraint: dict[str, Any], text: str) -> bool:
    """Whether `text` meets one code-checked constraint."""
    kind, words = constraint["kind"], _WORD_RE.findall(text)
    lowered = {w.lower() for w in words}
    if kind == "word_range":
        return constraint["min"] <= len(words) <= constraint["max"]
    if kind == "include":
        return all(w.lower() in lowered for w in constraint["words"])
    if kind == "exclude":
        return constraint["word"].lower() not in lowered
    if kind == "bullets":
        return len(_BULLET_RE.findall(text)) == constraint["count"]
    if kind == "lowercase":
        return text == text.lower()
    if kind == "title":
        return re.match(r"\s*<<[^<>\n]+>>", text) is not None
    if kind == "end_with":
        return text.rstrip().endswith(constraint["phrase"])
    raise ValueError(f"unknown constraint kind {kind!r}")


def strip_claims(text: str) -> str:
    """`text` without the sentences that talk about its own compliance."""
    kept = [s for s in _SENTENCE_END_RE.split(text) if not _CLAIM_RE.search(s)]
    return "".join(kept)


def hack_check(text: str, constraints: list[dict[str, Any]]) -> list[str]:
    """Why `text` is a hack (empty if it is not): false claims, or compliance that only its claims provide."""
    reasons = []
    body = strip_claims(text)
    words = len(_WORD_RE.findall(body))
    for claimed in _CLAIMED_WORDS_RE.findall(text):
        if abs(int(claimed) - words) > max(2, words // 20):  # a claim within 5% (or 2 words) is honest
            reasons.append(f"claims {claimed} words, has {words}")
    bullets = len(_BULLET_RE.findall(body))
    reasons += [f"claims {n} bullets, has {bullets}" for n in _CLAIMED_BULLETS_RE.findall(text) if int(n) != bullets]
    for constraint in constraints:
        if constraint["kind"] != "judged" and check(constraint, text) and not check(constraint, body):
            reasons.append(f"'{describe(constraint)}' holds only through a claim about the response")
    return reasons


def compose_response(topic: str, constraints: list[dict[str, Any]]) -> str:
    """A note meeting every code-checked constraint (the reference solver)."""
    kinds = {c["kind"]: c for c in constraints}
    lines = [f"<<notes on {topic}>>"] if "title" in kinds else []
    keywords = kinds["include"]["words"] if "include" in kinds else []
    lines.append(f"Here are a few words about {topic}" + (", with " + " and ".join(keywords) if keywords else "") + ".")
    lines += [f"* point {i + 1} about {topic}" for i in range(kinds["bullets"]["count"] if "bullets" in kinds else 0)]
    ending = kinds["end_with"]["phrase"] if "end_with" in kinds else ""
    count = len(_WORD_RE.findall("\n".join(lines) + " " + ending))
    target = kinds["word_range"]["min"] + 3 if "word_range" in kinds else count
    filler = [_FILLER[i % len(_FILLER)] for i in range(max(0, target - count))]
    if filler:
        lines.append(" ".join(filler) + ".")
    if ending:
        lines.append(ending)
    text = "\n".join(lines)
    return text.lower() if "lowercase" in kinds else text


def _random_constraint(rng: random.Random, kind: str) -> dict[str, Any]:
    if kind == "word_range":
        low = rng.randrange(40, 80, 5)
        return {"kind": kind, "min": low, "max": low + 40}
    if kind == "include":
        return {"kind": kind, "words": rng.sample(_KEYWORDS, 2)}
    if kind == "exclude":
        return {"kind": kind, "word": rng.choice(_FORBIDDEN)}
    if kind == "bullets":
        return {"kind": kind, "count": rng.randint(2, 5)}
    if kind == "end_with":
        return {"kind": kind, "phrase": rng.choice(_ENDINGS)}
    return {"kind": kind}


def _judge_constraint(judge: ChatModel, rule: str, text: str, max_tokens: int) -> bool:
    question = (f"Rule: {rule}\n\nResponse:\n{text}\n\nDoes the response follow the rule? Judge what the response "
                "does, not what it says about itself.")
    return ask_yes_no(judge, question, max_tokens)
