"""The files of a resumable evaluation directory, shared by `openk2 eval` and `openk2 redteam`.

Records are JSON lines appended one at a time; a crash can leave the last one half-written, which readers skip
and `drop_partial_line` cuts before the next append. `claim_directory` pins a directory to the settings its
records were made under, so a rerun never mixes records of two configurations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from openk2.fileio import atomic_write_text

SETTINGS_FILE = "settings.json"


def read_records(path: str | Path) -> list[dict]:
    """The records of a JSONL file (none if it does not exist); a line cut off by a crash is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def drop_partial_line(path: Path) -> None:
    """Cut a record left half-written by a crash, so the next append starts on a line of its own."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def claim_directory(directory: Path, settings: dict[str, Any]) -> None:
    """Record `settings` in `directory`, or raise ValueError naming what differs from the ones already there."""
    path = directory / SETTINGS_FILE
    if path.exists():
        previous = json.loads(path.read_text())
        if previous != settings:
            changed = sorted(k for k in set(previous) | set(settings) if previous.get(k) != settings.get(k))
            raise ValueError(f"{directory} holds records from a run with other settings ({', '.join(changed)}); "
                             "use another --out directory or delete it")
        return
    atomic_write_text(path, json.dumps(settings, indent=2))
