"""Self-critique rubric reward (report 3.2.1, "Beyond Verification"): the policy, acting as critic, compares
pairs of its own responses against rubrics; a response's reward is its win rate against its siblings.

Rubrics come in four kinds: `core` (the values every answer should have), `prescriptive` (against reward
hacking: flattery, padding, self-praise, unverifiable claims), `task` (what a task's answer must achieve, see
`TASK_RUBRICS`) and `user` (loaded from files). Any rubric can be mandatory: if the
critic finds that exactly one response of a pair breaks a mandatory rubric, that response loses whatever
the rest of the verdict says; otherwise the critic weighs the rubrics as it sees fit.

Each pair is judged in both orders and the two verdicts averaged, cancelling the critic's position bias.

Critic refinement: on prompts with a verifier, `CriticCalibration` compares the critic's verdicts with the
verified rewards (agreement rate) and exports the pairs, with the verdict the verifier implies, as chat
training data for the critic: the "verifiable signals" the report uses to keep the critic grounded.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from openk2.llm.base import ChatModel
from openk2.rl.tasks.base import Problem, Task

RUBRIC_KINDS = ("core", "prescriptive", "task", "user")


@dataclass(frozen=True)
class Rubric:
    """One evaluation criterion for the critic."""

    name: str
    text: str
    kind: str = "user"
    mandatory: bool = False

    def __post_init__(self) -> None:
        if self.kind not in RUBRIC_KINDS:
            raise ValueError(f"rubric {self.name!r}: kind must be one of {RUBRIC_KINDS}, got {self.kind!r}")
        if not self.name or not self.text:
            raise ValueError("a rubric needs a non-empty name and text")


# Our own wording of the report's two built-in families (its Appendix F lists Kimi's).
CORE_RUBRICS = (
    Rubric("helpful", "Addresses what the user actually asked, completely, with the most useful content first.",
           "core"),
    Rubric("honest", "States only what is true or well supported; says so plainly when unsure or when it cannot "
           "do something.", "core", mandatory=True),
    Rubric("harmless", "Does not help with clearly harmful or illegal aims; declines briefly and offers a safe "
           "alternative.", "core", mandatory=True),
    Rubric("clear", "Is well organised and easy to follow, in the user's language and at the user's level.", "core"),
)
PRESCRIPTIVE_RUBRICS = (
    Rubric("no-flattery", "Does not praise the user or the question, and does not open with filler such as "
           "'Great question!'.", "prescriptive"),
    Rubric("no-padding", "Is no longer than the content needs: no restating the question, no generic caveats, no "
           "repeated summaries. Length alone is never a merit.", "prescriptive"),
    Rubric("no-self-assessment", "Does not claim its own quality or compliance ('this answer is accurate and "
           "complete'); only the content counts.", "prescriptive", mandatory=True),
    Rubric("no-unverifiable-claims", "Claims nothing the response itself does not back up: no 'I checked / ran / "
           "verified this', no invented sources, figures or guarantees.", "prescriptive", mandatory=True),
)
# For prompts with a checkable answer (the closed loop's comparisons, rl/critic_loop.py).
TASK_RUBRICS = (
    Rubric("correct", "Reaches the right final answer to the task as posed; a wrong answer loses to a right one "
           "whatever its style.", "task", mandatory=True),
)
DEFAULT_RUBRICS = CORE_RUBRICS + PRESCRIPTIVE_RUBRICS

_WINNER_RE = re.compile(r"winner\s*:\s*\**\s*(A|B|tie)\b", re.IGNORECASE)
_VIOLATIONS_RE = re.compile(r"violations\s*:\s*\**\s*(A|B|both|none)\b", re.IGNORECASE)


def load_rubrics(path: str | Path) -> list[Rubric]:
    """User rubrics from a JSON list or JSON-lines file of {"name", "text", "mandatory"?} objects."""
    path = Path(path)
    try:
        text = path.read_text()
        rows = json.loads(text) if text.lstrip().startswith("[") else [json.loads(line) for line in
                                                                         text.splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read rubrics from {path}: {e}") from e
    rubrics = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not {"name", "text"} <= row.keys() or set(row) - {"name", "text", "mandatory"}:
            raise ValueError(f"{path}: rubric {i} must be an object with name, text and optional mandatory")
        rubrics.append(Rubric(str(row["name"]), str(row["text"]), "user", bool(row.get("mandatory", False))))
    return rubrics


@dataclass
class Judgment:
    """The critic's verdict on (a, b): `score` is a's share of the win (1 a wins, 0 b wins, 0.5 tie)."""

    score: float
    violates_mandatory: tuple[bool, bool]
    replies: list[str] = field(default_factory=list)

    @property
    def winner(self) -> int | None:
        """0 if a won, 1 if b won, None for a tie."""
        return None if self.score == 0.5 else (0 if self.score > 0.5 else 1)


class CriticFormat:
    """How the critic is asked and how its reply is read: the rubric prompt (`critic_messages`) and its
    "Violations: / Winner:" closing lines (`parse_verdict`). `rl/critic_compact.py` has a short one."""

    name = "rubric"

    def messages(self, rubrics: Sequence[Rubric], prompt: str, first: str, second: str) -> list[dict]:
        """The conversation comparing `first` (A) with `second` (B) as responses to `prompt`."""
        return critic_messages(rubrics, prompt, first, second)

    def parse(self, reply: str, first: str, second: str) -> tuple[str | None, tuple[bool, bool]]:
        """('A' | 'B' | 'TIE' | None, (A violates a mandatory rubric, B does)) from one reply."""
        return parse_verdict(reply)


RUBRIC_FORMAT = CriticFormat()


class SelfCritic:
    """Pairwise rubric critic over any `ChatModel` (in K2: the policy itself)."""

    def __init__(self, model: ChatModel | None, rubrics: Sequence[Rubric] = DEFAULT_RUBRICS, max_tokens: int = 512,
                 fmt: CriticFormat = RUBRIC_FORMAT):
        """`model` may be None in a subclass that overrides `replies` (e.g. a batched engine)."""
        if not rubrics:
            raise ValueError("the critic needs at least one rubric")
        self.model, self.rubrics, self.max_tokens, self.fmt = model, list(rubrics), max_tokens, fmt

    def messages(self, prompt: str, first: str, second: str) -> list[dict]:
        """The critic's conversation for one ordered comparison (first is A, second is B)."""
        return self.fmt.messages(self.rubrics, prompt, first, second)

    def replies(self, conversations: Sequence[list[dict]]) -> list[str]:
        """The critic's greedy reply to each conversation (one chat call each; subclasses may batch)."""
        assert self.model is not None, "SelfCritic without a model must override replies"
        return [self.model.chat(c, temperature=0.0, max_tokens=self.max_tokens)[0].content or ""
                for c in conversations]

    def compare(self, prompt: str, a: str, b: str) -> Judgment:
        """Judge a against b, once in each order."""
        return self.judge(prompt, [(a, b)])[0]

    def judge(self, prompt: str, pairs: Sequence[tuple[str, str]]) -> list[Judgment]:
        """`compare` for many pairs of responses to one prompt, with one `replies` call for all of them."""
        orders = [(first, second) for a, b in pairs for first, second in ((a, b), (b, a))]
        replies = self.replies([self.messages(prompt, first, second) for first, second in orders])
        judgments = []
        for p in range(len(pairs)):
            a_votes, violations = [], [False, False]
            for o, first_is_a in ((2 * p, True), (2 * p + 1, False)):
                winner, violated = self.fmt.parse(replies[o], *orders[o])
                first_vote = {"A": 1.0, "B": 0.0, "TIE": 0.5, None: 0.5}[winner]
                a_votes.append(first_vote if first_is_a else 1.0 - first_vote)
                a_side, b_side = (violated[0], violated[1]) if first_is_a else (violated[1], violated[0])
                violations = [violations[0] or a_side, violations[1] or b_side]
            score = sum(a_votes) / len(a_votes)
            if violations[0] != violations[1]:  # mandatory rubrics override the overall preference
                score = 0.0 if violations[0] else 1.0
            judgments.append(Judgment(score, (violations[0], violations[1]), replies[2 * p: 2 * p + 2]))
        return judgments

    def rewards(self, prompt: str, responses: Sequence[str]) -> list[float]:
        """Each response's mean win share against every other response (round robin); in [0, 1]."""
        if len(responses) < 2:
            raise ValueError("pairwise rewards need at least two responses")
        index = list(itertools.combinations(range(len(responses)), 2))
        judgments = self.judge(prompt, [(responses[i], responses[j]) for i, j in index])
        wins = [0.0] * len(responses)
        for (i, j), judgment in zip(index, judgments, strict=True):
            wins[i] += judgment.score
            wins[j] += 1.0 - judgment.score
        return [w / (len(responses) - 1) for w in wins]


def critic_messages(rubrics: Sequence[Rubric], prompt: str, first: str, second: str) -> list[dict]:
    """The critic's conversation comparing `first` (A) with `second` (B) as responses to `prompt`."""
    rubric_lines = "\n".join(f"- [{r.kind}{', mandatory' if r.mandatory else ''}] {r.name}: {r.text}"
                             for r in rubrics)
    content = (
        "Compare two responses to the same user prompt against these rubrics. A response that breaks a "
        "mandatory rubric should lose to one that does not; weigh the others with your own judgment.\n\n"
        f"Rubrics:\n{rubric_lines}\n\nUser prompt:\n{prompt}\n\nResponse A:\n{first}\n\nResponse B:\n{second}"
        "\n\nReason briefly, then end with exactly two lines:\nViolations: <A, B, both or none> (mandatory "
        "rubrics only)\nWinner: <A, B or tie>")
    return [{"role": "user", "content": content}]


def parse_verdict(reply: str) -> tuple[str | None, tuple[bool, bool]]:
    """('A' | 'B' | 'TIE' | None, (A violates a mandatory rubric, B does)) from a critic reply; last lines win."""
    winners = _WINNER_RE.findall(reply)
    violations = _VIOLATIONS_RE.findall(reply)
    flag = violations[-1].upper() if violations else "NONE"
    return (winners[-1].upper() if winners else None), (flag in ("A", "BOTH"), flag in ("B", "BOTH"))


@dataclass
class CalibrationPair:
    """A critic verdict on two responses whose verified rewards differ."""

    prompt: str
    a: str
    b: str
    reward_a: float
    reward_b: float
    critic_score: float

    @property
    def agrees(self) -> bool:
        """Whether the critic preferred the response the verifier rewarded more."""
        return (self.critic_score > 0.5) == (self.reward_a > self.reward_b) and self.critic_score != 0.5


class CriticCalibration:
    """Bookkeeping for refining the critic with verifiable tasks: agreement rate and critic training data."""

    def __init__(self) -> None:
        self.pairs: list[CalibrationPair] = []

    def check(self, critic: SelfCritic, task: Task, problem: Problem, responses: Sequence[str],
              rewards: Sequence[float] | None = None) -> list[CalibrationPair]:
        """Judge every pair of `responses` whose verified rewards differ; record and return those pairs."""
        if rewards is None:
            rewards = [task.verify(problem, r) for r in responses]
        if len(rewards) != len(responses):
            raise ValueError(f"{len(responses)} responses but {len(rewards)} rewards")
        added = []
        for i, j in itertools.combinations(range(len(responses)), 2):
            if rewards[i] == rewards[j]:
                continue  # the verifier has no preference to check against
            judgment = critic.compare(problem.prompt, responses[i], responses[j])
            added.append(CalibrationPair(problem.prompt, responses[i], responses[j], float(rewards[i]),
                                         float(rewards[j]), judgment.score))
        self.pairs += added
        return added

    @property
    def agreement_rate(self) -> float | None:
        """The fraction of recorded pairs on which the critic agreed with the verifier (None before any)."""
        return sum(p.agrees for p in self.pairs) / len(self.pairs) if self.pairs else None

    def export(self, path: str | Path, critic: SelfCritic) -> int:
        """Write the pairs as critic training data (both orders); the row count.

        Rows are the SFT conversation shape (`{"messages": [...]}`, see openk2.data.conversations), so
        `openk2 sft` trains on them as is. The target verdict is the verifier's: the better-verified
        response wins, with no mandatory violation.
        """
        from openk2.data.conversations import write_conversations  # tokenizer deps only when exporting

        rows = []
        for pair in self.pairs:
            for first, second, first_better in ((pair.a, pair.b, pair.reward_a > pair.reward_b),
                                                (pair.b, pair.a, pair.reward_b > pair.reward_a)):
                verdict = f"Violations: none\nWinner: {'A' if first_better else 'B'}"
                rows.append({"messages": [*critic.messages(pair.prompt, first, second),
                                          {"role": "assistant", "content": verdict}]})
        write_conversations(path, rows)  # atomic: a crash never leaves half a file
        return len(rows)
