"""Faithfulness: answer a question from a given context; every claim must be supported by that context.

Contexts are generated facts about fictional towns (so a model cannot answer from memory); higher levels ask
about more facts and add a distractor town. The reward is 1.0 iff the answer (after ``Answer:``) states every
asked fact and the judge finds each of its sentences supported by the context, in the spirit of
FACTS-Grounding's sentence-level checks (report 3.2.1); the judge is any `ChatModel`.
"""

from __future__ import annotations

import random
import re

from openk2.llm.base import ChatModel
from openk2.rl.tasks.base import Problem, Task, extract_answer
from openk2.rl.tasks.judge import ask_yes_no, require_judge

_SYLLABLES = ("kor", "vel", "mar", "tis", "lun", "bro", "deh", "sal", "qui", "ren", "tor", "ab")
_RIVERS = ("Vell", "Ostra", "Minn", "Caddow", "Lirra")
_EXPORTS = ("copper", "wool", "glass", "salt", "cider", "timber")
_MAYORS = ("Dana Holt", "Ilse Varga", "Tomas Reyes", "Mira Okafor", "Jon Halvorsen")
_FACTS = {  # attribute -> (fact sentence, question)
    "river": ("{town} lies on the {river} river.", "On which river does {town} lie?"),
    "population": ("{town} has {population} residents.", "How many residents does {town} have?"),
    "export": ("The main export of {town} is {export}.", "What is the main export of {town}?"),
    "mayor": ("The mayor of {town} is {mayor}.", "Who is the mayor of {town}?"),
    "founded": ("{town} was founded in {founded}.", "In which year was {town} founded?"),
}
_LEVELS = {1: (1, False), 2: (2, False), 3: (2, True), 4: (3, True), 5: (4, True)}  # questions, distractor town
_SENTENCE_RE = re.compile(r"[^.!?\n]+[.!?]?")


class FaithfulnessTask(Task):
    name = "faithfulness"
    num_difficulties = len(_LEVELS)
    max_tokens = 1024

    def __init__(self, judge: ChatModel | None = None, judge_max_tokens: int = 256):
        self.judge, self.judge_max_tokens = judge, judge_max_tokens

    def generate(self, seed: int, difficulty: int = 1) -> Problem:
        difficulty = self._check_difficulty(difficulty)
        rng = random.Random(f"{self.name}:{seed}:{difficulty}")
        num_questions, distractor = _LEVELS[difficulty]
        towns = _random_towns(rng, 2 if distractor else 1)
        sentences = [fact.format(**town) for town in towns for fact, _ in _FACTS.values()]
        rng.shuffle(sentences)
        context = " ".join(sentences)
        asked = rng.sample(sorted(_FACTS), num_questions)
        target = towns[0]
        questions = " ".join(_FACTS[a][1].format(**target) for a in asked)
        answers = [str(target[a]) for a in asked]
        prompt = f"Answer using only the context below.\n\nContext: {context}\n\nQuestion: {questions}"
        return self._problem(prompt, {"context": context, "question": questions, "answers": answers}, seed, difficulty)

    def verify(self, problem: Problem, response_text: str) -> float:
        judge = require_judge(self.judge, self.name)
        answer = extract_answer(response_text, multiline=True)
        if answer is None or not all(a.lower() in answer.lower() for a in problem.data["answers"]):
            return 0.0
        claims = split_claims(answer)
        return float(bool(claims) and all(is_supported(judge, problem.data["context"], c, self.judge_max_tokens)
                                            for c in claims))


def split_claims(text: str) -> list[str]:
    """The sentences of `text`, each one claim to check."""
    return [s.strip() for s in _SENTENCE_RE.findall(text) if s.strip(" .!?")]


def is_supported(judge: ChatModel, context: str, claim: str, max_tokens: int = 256) -> bool:
    """Whether the judge finds `claim` stated in, or directly implied by, `context`."""
    question = (f"Context:\n{context}\n\nClaim: {claim}\n\nIs every detail of the claim stated in, or directly "
                "implied by, the context?")
    return ask_yes_no(judge, question, max_tokens)


def _random_towns(rng: random.Random, count: int) -> list[dict[str, str | int]]:
    names: set[str] = set()
    while len(names) < count:
        names.add("".join(rng.sample(_SYLLABLES, 2)).capitalize())
    return [{"town": name, "river": rng.choice(_RIVERS), "population": rng.randrange(800, 20000, 10),
             "export": rng.choice(_EXPORTS), "mayor": rng.choice(_MAYORS), "founded": rng.randint(1100, 1900)}
            for name in sorted(names)]
