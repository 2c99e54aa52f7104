"""Yes/no questions to an LLM judge (any `ChatModel`), shared by the LLM-judged tasks and the critic."""

from __future__ import annotations

import re

from openk2.llm.base import ChatModel

_VERDICT_RE = re.compile(r"\b(YES|NO)\b")


def ask_yes_no(judge: ChatModel, question: str, max_tokens: int = 256) -> bool:
    """The judge's verdict on `question`; the last standalone YES or NO in its reply wins, none means NO."""
    prompt = f"{question.rstrip()}\nThink briefly if needed, then end with a line that is exactly YES or NO."
    reply = judge.chat([{"role": "user", "content": prompt}], temperature=0.0, max_tokens=max_tokens)[0]
    return parse_yes_no(reply.content or "") is True


def parse_yes_no(text: str) -> bool | None:
    """A verdict from a judge's reply: its last line if that is a bare yes/no, else the last upper-case YES or NO
    anywhere (lower-case 'no' inside reasoning is not a verdict), else its first word; None if there is none.

    >>> parse_yes_no("The note is cheerful.\\nYES"), parse_yes_no("NO, it is not."), parse_yes_no("hmm")
    (True, False, None)
    """
    lines = [line.strip(" .*!:") for line in text.strip().splitlines() if line.strip()]
    if lines and lines[-1].upper() in ("YES", "NO"):
        return lines[-1].upper() == "YES"
    verdicts = _VERDICT_RE.findall(text)
    if verdicts:
        return verdicts[-1] == "YES"
    first = text.strip().split(maxsplit=1)[0].strip(" .,!:").upper() if text.strip() else ""
    return {"YES": True, "NO": False}.get(first)


def require_judge(judge: ChatModel | None, task: str) -> ChatModel:
    """`judge`, or a ValueError telling the user to pass one."""
    if judge is None:
        raise ValueError(f"task {task!r} needs an LLM judge: build it with get({task!r}, judge=<ChatModel>)")
    return judge
