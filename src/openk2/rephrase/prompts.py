"""The prompt bank for rephrasing: styles and perspectives (after WRAP), math learning notes, translation.

Report section 2.2: "style- and perspective-diverse prompting ... to guide an LLM to faithfully rephrase original
texts in varied styles and perspectives"; math documents are rewritten as learning notes (after SwallowMath) and
non-English math material is translated into English. Every prompt asks for the same facts in a new form; the
passage to rewrite always sits between <passage> tags so a rewrite never confuses it with the instructions.

A style file (JSON or TOML) adds styles or overrides built-in ones:

    [eli5]                                   # TOML; JSON is {"eli5": {"instruction": "...", ...}}
    instruction = "Explain the passage to a curious ten-year-old."
    mode = "rephrase"                        # or "math-note" / "translate"
    check_similarity = true                  # false skips the MiniLM check (e.g. for non-English sources)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path

from openk2.configfile import read_toml
from openk2.data.sources import read_utf8

MODES = ("rephrase", "math-note", "translate")

# One system prompt per mode: what stays fixed whatever the style.
SYSTEM_PROMPTS = {
    "rephrase": (
        "You rewrite text in a requested style. Keep every fact, name, number, date and claim of the original, "
        "and add no fact that is not in it. Reply with the rewritten text only, without a preamble."
    ),
    "math-note": (
        "You turn mathematical text into clear learning notes. Keep every number, formula, definition and result "
        "exactly; add steps of reasoning only where they follow from the text. Reply with the notes only."
    ),
    "translate": (
        "You translate text into fluent English. Keep every fact, name, number and formula exactly, translate "
        "rather than summarise, and reply with the English text only."
    ),
}


@dataclass(frozen=True)
class RephraseStyle:
    """One way to rewrite a passage: the instruction the LLM gets and how the rewrite is checked."""

    name: str
    instruction: str
    mode: str = "rephrase"  # picks the system prompt
    check_similarity: bool = True  # MiniLM is English-only, so translation turns this off

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"style {self.name!r}: mode must be one of {MODES}, got {self.mode!r}")
        if not self.instruction.strip():
            raise ValueError(f"style {self.name!r} has an empty instruction")


def _style(name: str, instruction: str, **kw) -> tuple[str, RephraseStyle]:
    return name, RephraseStyle(name, instruction, **kw)


STYLES: dict[str, RephraseStyle] = dict([
    _style("encyclopedic", "Rewrite the passage as a neutral, well-organised encyclopedia entry."),
    _style("conversational", "Rewrite the passage as one friend telling another about it in a relaxed, "
                             "spoken tone."),
    _style("qa", "Rewrite the passage as a series of questions and answers that together cover all of its "
                 "content."),
    _style("textbook", "Rewrite the passage as a section of a textbook that teaches its content to students."),
    _style("child", "Rewrite the passage so that a ten-year-old can follow it, using simple words and short "
                    "sentences."),
    _style("critic", "Rewrite the passage from the perspective of a careful critic who reports what it says and "
                     "comments on it, without changing any of its facts."),
    _style("news", "Rewrite the passage as a short news report."),
    _style("summary-notes", "Rewrite the passage as concise study notes in full sentences, one point per line."),
    _style("math-note", "Rewrite the passage as a learning note: state what is asked or defined, work through "
                        "the steps with a reason for each, and end with the result.", mode="math-note"),
    _style("translate-en", "Translate the passage into English.", mode="translate", check_similarity=False),
])

DEFAULT_STYLES = ("encyclopedic", "conversational", "qa", "textbook", "child", "critic")


def load_styles(path: str | Path | None = None) -> dict[str, RephraseStyle]:
    """The built-in bank, extended (or overridden name by name) by a JSON or TOML style file."""
    styles = dict(STYLES)
    if path is None:
        return styles
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"style file {path} does not exist")
    if path.suffix == ".toml":
        raw = read_toml(path, inherit=False)  # style names are the top-level keys, so `base` is a style here
    else:
        try:
            raw = json.loads(read_utf8(path))
        except json.JSONDecodeError as err:
            raise ValueError(f"style file {path} is not valid {path.suffix.lstrip('.') or 'JSON'}: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"style file {path} must map style names to tables")
    known = {f.name for f in fields(RephraseStyle)} - {"name"}
    for name, spec in raw.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("instruction"), str):
            raise ValueError(f"style {name!r} in {path} needs a string 'instruction'")
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"style {name!r} in {path}: unknown keys {unknown}; allowed: {sorted(known)}")
        styles[name] = RephraseStyle(name, **spec)
    return styles


def select_styles(names: list[str], bank: dict[str, RephraseStyle]) -> list[RephraseStyle]:
    """The named styles in order; an unknown name is a ValueError listing the bank."""
    missing = [n for n in names if n not in bank]
    if missing:
        raise ValueError(f"unknown style(s) {missing}; available: {sorted(bank)}")
    if not names:
        raise ValueError("at least one style is needed")
    return [bank[n] for n in names]


def rewrite_messages(style: RephraseStyle, segment: str, previous: str, part: int, num_parts: int) -> list[dict]:
    """Chat messages asking for the rewrite of one segment, given the tail of the rewrite so far."""
    lines = [style.instruction]
    if num_parts > 1:
        lines.append(f"The passage is part {part + 1} of {num_parts} of a longer document.")
    if previous:
        lines += ["Your rewrite of the earlier parts ends like this; continue from it without repeating it:",
                  f"<previous>\n{previous}\n</previous>"]
    lines.append(f"<passage>\n{segment.strip()}\n</passage>")
    return [{"role": "system", "content": SYSTEM_PROMPTS[style.mode]}, {"role": "user", "content": "\n\n".join(lines)}]


JUDGE_SYSTEM = (
    "You check rewrites for faithfulness. A rewrite is FAITHFUL when it states the same facts as the original, "
    "in any wording or style; it is UNFAITHFUL when it drops a fact of the original or adds one that is not there."
)


def judge_messages(source: str, rewrite: str) -> list[dict]:
    """Chat messages asking an LLM judge whether `rewrite` adds or loses facts relative to `source`."""
    user = (f"<original>\n{source.strip()}\n</original>\n\n<rewrite>\n{rewrite.strip()}\n</rewrite>\n\n"
            "Answer with one word: FAITHFUL or UNFAITHFUL.")
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


def parse_verdict(reply: str | None) -> bool | None:
    """True for FAITHFUL, False for UNFAITHFUL, None when the reply says neither."""
    words = re.findall(r"[A-Za-z]+", (reply or "").upper())
    if "UNFAITHFUL" in words:
        return False
    return True if "FAITHFUL" in words else None


_PREAMBLE = re.compile(
    r"^\s*(?:sure|certainly|of course|okay|ok)?[,.!]?\s*(?:here(?:'s| is| are)\b[^\n]*?:)\s*", re.IGNORECASE
)
_TAGS = re.compile(r"</?(?:passage|previous|rewrite)>")


def clean_rewrite(reply: str | None) -> str:
    """The rewrite without a chatty preamble ("Here is the rewritten text:") or echoed prompt tags."""
    text = _TAGS.sub("", reply or "")
    return _PREAMBLE.sub("", text, count=1).strip()
