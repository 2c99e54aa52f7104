"""The tool-execution simulator (report 3.1.1: "functionally a world model"): one instance per episode.

For each call the simulator
1. checks the tool exists and that the arguments are a bounded JSON object (size, depth, finite numbers, valid
   Unicode) matching the tool's parameter schema; problems go back to the agent as a tool error, as a real API
   would answer, and never raise;
2. draws the episode's stochastic outcome from one uniform number per call, cut into the `FaultConfig`
   probabilities (so each fault occurs at exactly its configured rate): a timeout or rate limit (the call does
   nothing), an edge case (no rows, a missing record, a conflict; nothing changes) or a partial result; the
   RNG is seeded by (seed, episode id), so an episode replays identically;
3. executes it: for real by an MCP server when the tool is marked safe (e.g. the clock), in the code sandbox
   for code tools (`openk2.agentic.coding`), else against the episode's `World` (`openk2.agentic.world`), the
   seeded database that holds every entity: results and state come from the world, never from a model;
4. lets a model, when one is given, phrase the text fields the world only faked (placeholders such as
   "title-123"); the phrased text is stored in the world, so later reads agree with it.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from typing import Any

from openk2.agentic.jsonout import JSON_INSTRUCTION, JSONStats, ask_json
from openk2.agentic.mcp_client import MCPServer
from openk2.agentic.schema import value_problems
from openk2.agentic.tools import Tool
from openk2.agentic.world import World
from openk2.agentic.world import fake_value as fake_value  # re-exported: tests and fakes draw values with it
from openk2.llm.base import ChatModel

MAX_ARGUMENT_BYTES = 16 << 10  # a tool call's arguments, as JSON text
MAX_ARGUMENT_DEPTH = 16  # nesting of objects and arrays in the arguments


@dataclass(kw_only=True)
class FaultConfig:
    """Per-call probabilities of injected outcomes (report: "controlled stochasticity ... partial failures and
    edge cases"). Timeouts and rate limits stop the call; an edge case answers "nothing matched" and changes
    nothing; a partial result truncates the answer of a call that did run. They are exclusive: each occurs at its
    own rate while they sum to <= 1; past that, earlier ones in this order take precedence."""

    timeout: float = 0.05
    rate_limit: float = 0.05
    partial: float = 0.05
    edge_case: float = 0.05

    def __post_init__(self) -> None:
        for name, p in asdict(self).items():
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"fault probability {name} must be in [0, 1], got {p}")

    def pick(self, u: float) -> str | None:
        """The fault for uniform draw `u` in [0, 1): timeout, rate_limited, edge_case, partial, or None."""
        edge = 0.0
        for outcome, p in (("timeout", self.timeout), ("rate_limited", self.rate_limit),
                           ("edge_case", self.edge_case), ("partial", self.partial)):
            edge += p
            if u < edge:
                return outcome
        return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_ARGUMENT_DEPTH:
                break
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def parse_arguments(raw: Any, max_bytes: int = MAX_ARGUMENT_BYTES) -> tuple[dict | None, str | None]:
    """(arguments, None) for a usable arguments object (JSON text or a dict), else (None, the problem)."""
    if isinstance(raw, dict):
        try:
            raw = json.dumps(raw, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, RecursionError) as err:
            return None, f"arguments are not serialisable JSON: {type(err).__name__}"
    if not isinstance(raw, str):
        return None, f"arguments must be a JSON object as text, got {type(raw).__name__}"
    size = len(raw.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        return None, f"arguments are {size} bytes; the limit is {max_bytes}"
    try:
        args = json.loads(raw or "{}", parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError; so are 5000-digit integers
        return None, f"arguments are not JSON: {str(err)[:200] or type(err).__name__}"
    if not isinstance(args, dict):
        return None, f"arguments must be an object, got {type(args).__name__}"
    if _depth(args) > MAX_ARGUMENT_DEPTH:
        return None, f"arguments are nested deeper than {MAX_ARGUMENT_DEPTH} levels"
    try:
        json.dumps(args, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return None, "arguments hold invalid Unicode (a lone surrogate)"
    return args, None


def _phrase_validator(fields: list[str]):
    def validate(value: Any) -> dict[str, str]:
        if isinstance(value, dict) and isinstance(value.get("fields"), dict):
            value = value["fields"]
        if not isinstance(value, dict):
            raise ValueError('expected {"fields": {"name": "text", ...}}')
        got = {k: v.strip() for k, v in value.items() if k in fields and isinstance(v, str) and v.strip()
               and len(v) <= 300}
        if not got:
            raise ValueError(f"give a short text for at least one of: {', '.join(fields)}")
        return got
    return validate


class ToolSimulator:
    """Executes one episode's tool calls; `execute(call)` returns the tool message content (a JSON string).

    `world` is the episode's database (default: one built from `tools` with `world_rows` seeded rows per kind,
    seeded by (seed, world_key or episode_id)); `code` runs code tools in the sandbox
    (`openk2.agentic.coding.CodeRunner`)."""

    def __init__(self, tools: list[Tool], *, seed: int, episode_id: str, faults: FaultConfig | None = None,
                 model: ChatModel | None = None, real_servers: dict[str, MCPServer] | None = None,
                 stats: JSONStats | None = None, max_attempts: int = 3, world: World | None = None,
                 world_key: str | None = None, world_rows: int = 5, code: Any = None,
                 max_argument_bytes: int = MAX_ARGUMENT_BYTES, **sampling: Any) -> None:
        self.tools = {t.name: t for t in tools}
        self.faults = faults or FaultConfig()
        self.model = model
        self.real_servers = real_servers or {}  # tool name -> server that may run it for real
        self.code = code
        self.rng = random.Random(f"{seed}:tools:{episode_id}")
        code_names = set(getattr(code, "tool_names", ()))
        self.world = world if world is not None else World(
            [t for t in tools if t.name not in code_names and t.name not in self.real_servers], seed=seed,
            key=world_key or episode_id, rows_per_kind=world_rows)
        self.stats = stats
        self.max_attempts = max_attempts
        self.max_argument_bytes = max_argument_bytes
        self.sampling = sampling
        self.outcomes: dict[str, int] = {}

    @property
    def state(self) -> World:
        """The episode's world (tables, created/changed/deleted, the call log)."""
        return self.world

    def record(self) -> dict:
        """What the trajectory keeps: the world's final state, plus the code runs of a coding episode."""
        state = self.world.to_dict()
        if self.code is not None:
            state["code"] = self.code.to_dict()
        return state

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    async def execute(self, call: Any) -> str:
        """Run one OpenAI-shaped tool call and return what the tool answers."""
        fn = call.get("function") if isinstance(call, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        name, raw_args = fn.get("name", ""), fn.get("arguments", "{}")
        name = name if isinstance(name, str) else repr(name)
        # One draw (and one sub-seed) per call keeps later calls' outcomes independent of this call's branch.
        u = self.rng.random()
        sub_rng = random.Random(self.rng.getrandbits(64))
        outcome, result = await self._outcome(name, raw_args, u, sub_rng)
        self._count(outcome)
        self.world.calls.append({"index": len(self.world.calls), "name": name[:100],
                                 "arguments": _shown(raw_args)[:2000], "outcome": outcome})
        return json.dumps(result, ensure_ascii=False)

    async def _outcome(self, name: str, raw_args: Any, u: float, rng: random.Random) -> tuple[str, Any]:
        tool = self.tools.get(name)
        if tool is None:
            return "unknown_tool", {"error": "unknown_tool", "message": f"no tool named {name[:100]!r}",
                                    "available": sorted(self.tools)}
        args, problem = parse_arguments(raw_args, self.max_argument_bytes)
        if problem is not None:
            return "invalid_arguments", {"error": "invalid_arguments", "message": problem}
        problems = value_problems(args, tool.parameters)
        if problems:
            return "invalid_arguments", {"error": "invalid_arguments", "details": problems[:10]}
        if self.code is not None and name in self.code.tool_names:  # real execution: no injected faults
            return await self.code.execute(name, args)
        real = self.real_servers.get(name)
        if real is not None:  # real tools give real outcomes: no injected faults
            got = await real.acall_tool(name, args)
            return ("real_error" if got.is_error else "real"), _parse_text(got.as_message_content())
        fault = self.faults.pick(u)
        if fault == "timeout":
            return "timeout", {"error": "timeout", "message": f"{name} did not respond within 30 s"}
        if fault == "rate_limited":
            return "rate_limited", {"error": "rate_limited", "retry_after_s": rng.randint(1, 30)}
        if fault == "edge_case":
            return "edge_case", self.world.edge_case(name, args)
        status, result, touched = self.world.call(name, args)
        if status != "ok":
            return status, result
        result = await self._phrase(tool, touched, result)
        if fault == "partial":
            return "partial", _partial(result)
        return "ok", result

    async def _phrase(self, tool: Tool, touched: tuple[str, str] | None, result: Any) -> Any:
        """Let the model write the text fields the world only faked; the world stores what it wrote."""
        fields = self.world.phrasable(tool.name, touched, result) if self.model is not None else []
        if not fields or touched is None:
            return result
        prompt = (f"You are the tool `{tool.name}`: {tool.description}\nIts result, read from the database: "
                  f"{json.dumps(result, ensure_ascii=False)[:1500]}\nThese text fields hold placeholders: "
                  f"{', '.join(fields)}. Write a short realistic value for each, consistent with the rest of the "
                  f'result. Answer as JSON: {{"fields": {{"{fields[0]}": "..."}}}}. {JSON_INSTRUCTION}')
        schema = {"type": "object", "required": ["fields"], "additionalProperties": False, "properties": {
            "fields": {"type": "object", "required": fields, "additionalProperties": False,
                       "properties": {f: {"type": "string", "minLength": 1, "maxLength": 200} for f in fields}}}}
        got = await ask_json(self.model, [{"role": "user", "content": prompt}], _phrase_validator(fields),
                             schema=schema, stats=self.stats, max_attempts=self.max_attempts, **self.sampling)
        if got is None:
            self._count("phrasing_rejected")
            return result
        self.world.adopt(touched, got)
        return {**result, **got}


def _shown(raw: Any) -> str:
    """The arguments as recorded in the call log: the text itself, else JSON, else the type's name."""
    if isinstance(raw, str):
        return raw
    try:
        return json.dumps(raw, ensure_ascii=False, default=repr)
    except (ValueError, TypeError, RecursionError):
        return f"<{type(raw).__name__}>"


def _parse_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return {"text": text}


def _partial(result: Any) -> Any:
    """Keep the first half of every list (at least one item) and say so, as a paginated API would."""
    if isinstance(result, dict):
        out = {k: (v[: max(1, len(v) // 2)] if isinstance(v, list) else v) for k, v in result.items()}
        return {**out, "partial": True, "warning": "result truncated; the service returned partial data"}
    if isinstance(result, list):
        return {"items": result[: max(1, len(result) // 2)], "partial": True}
    return {"result": result, "partial": True}
