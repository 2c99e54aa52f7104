"""Arguments that several commands share, spelled once so that their names and help agree."""

from __future__ import annotations

import argparse


def add_set_argument(parser: argparse.ArgumentParser, example: str = "optim.lr=1e-3") -> None:
    """`--set SECTION.KEY=VALUE` (repeatable): overrides of the run file, checked like the file's own keys."""
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help=f"override a config value, e.g. --set {example} (repeatable)")


def add_resume_argument(parser: argparse.ArgumentParser) -> None:
    """`--resume`: continue a run from its newest complete checkpoint."""
    parser.add_argument("--resume", action="store_true", help="continue from the run's newest complete checkpoint")


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (`--max-steps 0` must not mean "no limit", nor -1 "do nothing")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {value}")
    return value


def work_limit(text: str) -> int | None:
    """argparse type: a non-negative whole number of tokens, 0 meaning no limit (None)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = no limit), got {value}")
    return value or None
