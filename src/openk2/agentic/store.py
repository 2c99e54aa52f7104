"""An append-only JSONL file of keyed records: the unit of resumability of `openk2 synth run`.

Each finished work item is appended as one line and flushed to disk at once, so a crash loses at most the
item in flight. On open, existing records are read back (their keys mark work already done); a last line cut
off by a crash is dropped and the file truncated to the last complete record before anything is appended.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class JsonlStore:
    """`store.has(key)`, `store.get(key)`, `store.append(record)`; records are dicts holding `key_field`."""

    def __init__(self, path: str | Path, key_field: str) -> None:
        self.path = Path(path)
        self.key_field = key_field
        self._records: dict[str, dict] = {}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        data = self.path.read_bytes()
        good_end = 0
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # cut off mid-write
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break
            if line.strip():
                self._records[str(record[self.key_field])] = record
            good_end += len(line)
        if good_end < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good_end)

    def has(self, key: str) -> bool:
        return key in self._records

    def get(self, key: str) -> dict | None:
        return self._records.get(key)

    def append(self, record: dict[str, Any]) -> None:
        key = str(record[self.key_field])
        if key in self._records:
            raise ValueError(f"{self.path.name}: record {key!r} already exists")
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self._records[key] = record

    def records(self) -> Iterator[dict]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)
