"""The tool repository (report 3.1.1, "Domain Evolution and Tool Generation"): tool specs with provenance.

A `Tool` is an OpenAI function schema (name, description, JSON-Schema parameters) plus a return schema,
the category and domain it belongs to, and where it came from: `source` is "mcp" (listed from a real MCP
server; `origin` holds the server's name and command) or "synthetic" (evolved by a model; `origin` holds the
model and domain). The repository is a JSONL file, one tool per line. Synthetic tools are validated before
they are kept (`tool_problems`) and near-duplicates are dropped by sentence-embedding similarity
(`dedup_tools`), so the repository does not fill up with the same tool under different names.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from openk2.agentic.schema import schema_problems
from openk2.data.sources import read_utf8

SOURCES = ("mcp", "synthetic")
TOOL_NAME = re.compile(r"^[a-zA-Z][a-zA-Z0-9_]{2,63}$")  # OpenAI's limit is 64 chars of [a-zA-Z0-9_-]


@dataclass
class Tool:
    """One tool spec with its provenance; `to_openai()` is what a model sees."""

    name: str
    description: str
    parameters: dict
    source: str
    returns: dict = field(default_factory=dict)
    category: str = ""
    domain: str = ""
    origin: dict = field(default_factory=dict)

    def to_openai(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict) -> Tool:
        known = {k: record[k] for k in cls.__dataclass_fields__ if k in record}
        missing = {"name", "description", "parameters", "source"} - set(known)
        if missing:
            raise ValueError(f"tool record lacks {', '.join(sorted(missing))}: {str(record)[:120]}")
        return cls(**known)

    @classmethod
    def from_mcp(cls, spec: dict) -> Tool:
        """A tool listed by `MCPServer.list_tools()` (OpenAI spec + `x-mcp` provenance)."""
        fn, meta = spec["function"], spec.get("x-mcp", {})
        return cls(name=fn["name"], description=fn.get("description", ""), parameters=fn.get("parameters", {}),
                   returns=meta.get("returns", {}), source="mcp", category="mcp", domain=meta.get("server", ""),
                   origin={"server": meta.get("server", ""), "command": meta.get("command", "")})

    def embedding_text(self) -> str:
        """What dedup compares: the name (underscores as spaces), description and parameter names."""
        params = ", ".join(self.parameters.get("properties", {}) or {})
        return f"{self.name.replace('_', ' ')}: {self.description} ({params})"


def tool_problems(record: Any) -> list[str]:
    """Why a synthesized tool spec is unusable (empty list if it is fine).

    Checks a clear name, a real description, an object `parameters` schema whose properties are all typed and
    described, `required` naming real properties, and a well-formed `returns` schema.
    """
    if not isinstance(record, dict):
        return [f"a tool must be an object, got {type(record).__name__}"]
    problems: list[str] = []
    name = record.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        problems.append(f"name {name!r} must be 3-64 chars of letters, digits and _ starting with a letter")
    desc = record.get("description")
    if not isinstance(desc, str) or len(desc.split()) < 3:
        problems.append("description must be a sentence (3+ words)")
    params = record.get("parameters")
    if not isinstance(params, dict) or params.get("type") != "object":
        problems.append("parameters must be a JSON Schema with type 'object'")
    else:
        problems += schema_problems(params, "parameters", require_descriptions=True)
    returns = record.get("returns", {"type": "object"})
    if not isinstance(returns, dict) or "type" not in returns:
        problems.append("returns must be a JSON Schema with a type")
    else:
        problems += schema_problems(returns, "returns")
    return problems


def synthetic_tool(record: dict, *, category: str, domain: str, origin: dict) -> Tool:
    """A validated synthetic `Tool` from a model's record; ValueError listing every problem otherwise."""
    problems = tool_problems(record)
    if problems:
        raise ValueError("; ".join(problems))
    return Tool(name=record["name"], description=record["description"].strip(), parameters=record["parameters"],
                returns=record.get("returns", {"type": "object"}), source="synthetic", category=category,
                domain=domain, origin=origin)


Embed = Callable[[list[str]], Any]  # texts -> [N, D] tensor with unit-norm rows


def dedup_tools(tools: Sequence[Tool], embed: Embed | None,
                threshold: float = 0.85) -> tuple[list[Tool], list[Tool]]:
    """(kept, dropped): the first tool of each name is kept, and later ones whose cosine similarity to a kept
    tool reaches `threshold` are dropped. MCP tools are never dropped (they are real); `embed=None` dedups by
    name only."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"dedup threshold must be in (0, 1], got {threshold}")
    ordered = sorted(tools, key=lambda t: t.source != "mcp")  # real tools claim their region of the space first
    kept: list[Tool] = []
    dropped: list[Tool] = []
    names: set[str] = set()
    for tool in ordered:
        if tool.name in names and tool.source != "mcp":
            dropped.append(tool)
        else:
            names.add(tool.name)
            kept.append(tool)
    if embed is None or len(kept) < 2:
        return kept, dropped
    vecs_ND = embed([t.embedding_text() for t in kept])
    sim_NN = vecs_ND @ vecs_ND.T
    final: list[int] = []
    for i, tool in enumerate(kept):
        if tool.source != "mcp" and final and float(sim_NN[i, final].max()) >= threshold:
            dropped.append(tool)
        else:
            final.append(i)
    return [kept[i] for i in final], dropped


def write_tools(path: str | Path, tools: Iterable[Tool]) -> int:
    """Write the repository atomically (temp file, then rename); returns the number of tools written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for tool in tools:
            f.write(json.dumps(tool.to_dict(), ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n


def read_tools(path: str | Path) -> list[Tool]:
    """The tools in a repository JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"tool repository {path} not found")
    tools = []
    for lineno, line in enumerate(read_utf8(path).splitlines(), 1):
        if line.strip():
            try:
                tools.append(Tool.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError) as err:
                raise ValueError(f"{path}:{lineno}: not a tool record ({err})") from None
    return tools


def tool_stats(tools: Sequence[Tool]) -> dict[str, Any]:
    """Counts per source, per category and per (source, domain)."""
    return {"total": len(tools),
            "by_source": dict(Counter(t.source for t in tools)),
            "by_category": dict(Counter(t.category for t in tools).most_common()),
            "by_domain": [{"source": s, "domain": d, "tools": n}
                          for (s, d), n in Counter((t.source, t.domain) for t in tools).most_common()]}


def format_stats(stats: dict[str, Any]) -> str:
    """`tool_stats` as a table for the terminal."""
    lines = [f"{stats['total']} tools: " + ", ".join(f"{n} {s}" for s, n in stats["by_source"].items()),
             f"{'source':<11}{'domain':<44}{'tools':>6}"]
    lines += [f"{row['source']:<11}{row['domain'][:43]:<44}{row['tools']:>6}" for row in stats["by_domain"]]
    return "\n".join(lines)
