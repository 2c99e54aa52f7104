"""Yes/no questions to an LLM judge (any `ChatModel`), shared by the LLM-judged tasks and the critic.

The question goes through the structured-output path (`openk2.llm.structured`) with `VERDICT_SCHEMA` (a short
reason, then the verdict): local backends decode it under the grammar, `openai:` endpoints get it as
`response_format`. A judge that answers in plain text anyway is read with `parse_yes_no`.
"""

from __future__ import annotations

import re

from openk2.llm.base import ChatModel
from openk2.llm.structured import chat_json

_VERDICT_RE = re.compile(r"\b(YES|NO)\b")
VERDICT_SCHEMA = {"type": "object", "properties": {"reason": {"type": "string", "maxLength": 200},
                                                   "verdict": {"enum": ["YES", "NO"]}},
                  "required": ["reason", "verdict"]}


def _verdict(value: object) -> bool:
    if not isinstance(value, dict) or value.get("verdict") not in ("YES", "NO"):
        raise ValueError('expected {"reason": "...", "verdict": "YES" or "NO"}')
    return value["verdict"] == "YES"


def ask_yes_no(judge: ChatModel, question: str, max_tokens: int = 256) -> bool:
    """The judge's verdict on `question` (structured; a plain-text reply's last standalone YES or NO wins, none
    means NO)."""
    prompt = (f"{question.rstrip()}\nThink briefly if needed, then give the verdict YES or NO. Answer as JSON: "
              '{"reason": "...", "verdict": "YES"}.')
    reply = chat_json(judge, [{"role": "user", "content": prompt}], VERDICT_SCHEMA, _verdict, max_attempts=1,
                      temperature=0.0, max_tokens=max_tokens)
    if reply.ok:
        return reply.value
    return parse_yes_no(reply.text or "") is True


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
