"""The tool-execution simulator (report 3.1.1: "functionally a world model"): one instance per episode.

For each call the simulator
1. checks the tool exists and validates the arguments against its parameter schema (errors go back to the
   agent as a tool result, as a real API would answer);
2. draws the episode's stochastic outcome: a timeout or rate limit (the call does nothing), or after execution
   a partial result or an edge case (empty results); probabilities in `FaultConfig`, draws from a RNG seeded by
   (seed, episode id), a fixed number per call, so an episode replays identically;
3. executes it: for real by an MCP server when the tool is marked safe (e.g. the clock), else by a model asked
   to act as the tool given the episode state so far, else (no model, or its reply unusable) by a seeded
   faker that fills the return schema;
4. records what the call created, changed or deleted in `WorldState`, which later calls and the judge see.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from openk2.agentic.jsonout import JSON_INSTRUCTION, JSONStats, ask_json
from openk2.agentic.mcp_client import MCPServer
from openk2.agentic.schema import value_problems
from openk2.agentic.tools import Tool
from openk2.llm.base import ChatModel

CREATE_VERBS = ("create", "add", "new", "book", "place", "schedule", "register", "open", "insert", "upload", "send")
CHANGE_VERBS = ("update", "set", "modify", "edit", "change", "move", "rename", "assign", "adjust", "transfer")
DELETE_VERBS = ("delete", "remove", "cancel", "close", "drop", "archive", "revoke")


@dataclass(kw_only=True)
class FaultConfig:
    """Per-call probabilities of injected outcomes (report: "controlled stochasticity ... partial failures and
    edge cases"). Timeouts and rate limits stop the call; partial results and edge cases alter its result."""

    timeout: float = 0.05
    rate_limit: float = 0.05
    partial: float = 0.05
    edge_case: float = 0.05

    def __post_init__(self) -> None:
        for name, p in asdict(self).items():
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"fault probability {name} must be in [0, 1], got {p}")


@dataclass
class WorldState:
    """What the episode's calls did: records created, changed and deleted (by key), and every call's outcome."""

    created: dict[str, Any] = field(default_factory=dict)
    changed: dict[str, Any] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)

    def apply(self, effects: list[dict]) -> None:
        for e in effects:
            key = str(e.get("key", ""))
            if not key:
                continue
            if e.get("op") == "create":
                self.created[key] = e.get("value")
            elif e.get("op") == "update":
                self.changed[key] = e.get("value")
            elif e.get("op") == "delete":
                self.created.pop(key, None)
                self.changed.pop(key, None)
                if key not in self.deleted:
                    self.deleted.append(key)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self, limit: int = 1500) -> str:
        text = json.dumps({"created": self.created, "changed": self.changed, "deleted": self.deleted},
                          ensure_ascii=False)
        return text if len(text) <= limit else text[:limit] + "...(truncated)"


def fake_value(schema: Any, rng: random.Random, hint: str = "value", depth: int = 0) -> Any:
    """A value that satisfies `schema` (the subset in `schema.py`), drawn from `rng`."""
    if not isinstance(schema, dict):
        return f"{hint}-{rng.randrange(1000)}"
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    kind = schema.get("type", "object" if "properties" in schema else "string")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if kind == "object":
        props = schema.get("properties", {}) if depth < 4 else {}
        return {k: fake_value(v, rng, k, depth + 1) for k, v in props.items()}
    if kind == "array":
        return [fake_value(schema.get("items", {}), rng, hint, depth + 1) for _ in range(rng.randint(1, 3))]
    if kind == "integer":
        lo, hi = int(schema.get("minimum", 0)), int(schema.get("maximum", 100))
        return rng.randint(lo, max(lo, hi))
    if kind == "number":
        lo, hi = float(schema.get("minimum", 0.0)), float(schema.get("maximum", 1000.0))
        return round(rng.uniform(lo, max(lo, hi)), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return f"{hint}-{rng.randrange(1000)}"


def verb_effects(tool_name: str, arguments: dict, result: Any, call_index: int) -> list[dict]:
    """State effects guessed from the tool's verb, used when the executor does not report any."""
    verb = tool_name.lower().split("_")[0]
    ids = [str(v) for k, v in arguments.items() if k == "id" or k.endswith("_id")]
    if verb in CREATE_VERBS:
        return [{"op": "create", "key": f"{tool_name}#{call_index}", "value": arguments}]
    if verb in CHANGE_VERBS:
        return [{"op": "update", "key": ids[0] if ids else f"{tool_name}#{call_index}", "value": arguments}]
    if verb in DELETE_VERBS and ids:
        return [{"op": "delete", "key": ids[0]}]
    return []


def _effects_validator(returns: dict):
    def validate(value: Any) -> dict:
        if not isinstance(value, dict) or "result" not in value:
            raise ValueError('expected {"result": ..., "effects": [...]}')
        problems = value_problems(value["result"], returns, "result") if returns else []
        if problems:
            raise ValueError("; ".join(problems[:5]))
        effects = value.get("effects", [])
        if not isinstance(effects, list):
            raise ValueError("effects must be a list")
        value["effects"] = [e for e in effects if isinstance(e, dict) and e.get("op") in ("create", "update", "delete")]
        return value
    return validate


class ToolSimulator:
    """Executes one episode's tool calls; `execute(call)` returns the tool message content (a JSON string)."""

    def __init__(self, tools: list[Tool], *, seed: int, episode_id: str, faults: FaultConfig | None = None,
                 model: ChatModel | None = None, real_servers: dict[str, MCPServer] | None = None,
                 stats: JSONStats | None = None, max_attempts: int = 3, **sampling: Any) -> None:
        self.tools = {t.name: t for t in tools}
        self.faults = faults or FaultConfig()
        self.model = model
        self.real_servers = real_servers or {}  # tool name -> server that may run it for real
        self.rng = random.Random(f"{seed}:tools:{episode_id}")
        self.state = WorldState()
        self.stats = stats
        self.max_attempts = max_attempts
        self.sampling = sampling
        self.outcomes: dict[str, int] = {}

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    async def execute(self, call: dict) -> str:
        """Run one OpenAI-shaped tool call and return what the tool answers."""
        fn = call.get("function", {})
        name, raw_args = fn.get("name", ""), fn.get("arguments", "{}")
        index = len(self.state.calls)
        # A fixed number of draws per call keeps later calls' outcomes independent of this call's branch.
        draw_timeout, draw_rate, draw_partial, draw_edge = (self.rng.random() for _ in range(4))
        sub_rng = random.Random(self.rng.getrandbits(64))
        outcome, result = await self._outcome(name, raw_args, index, (draw_timeout, draw_rate, draw_partial, draw_edge),
                                              sub_rng)
        self._count(outcome)
        self.state.calls.append({"index": index, "name": name, "arguments": raw_args, "outcome": outcome})
        return json.dumps(result, ensure_ascii=False)

    async def _outcome(self, name: str, raw_args: Any, index: int, draws: tuple[float, ...],
                       rng: random.Random) -> tuple[str, Any]:
        tool = self.tools.get(name)
        if tool is None:
            return "unknown_tool", {"error": "unknown_tool", "message": f"no tool named {name!r}",
                                    "available": sorted(self.tools)}
        try:
            args = json.loads(raw_args) if isinstance(raw_args, str) else raw_args
        except json.JSONDecodeError as err:
            return "invalid_arguments", {"error": "invalid_arguments", "message": f"arguments are not JSON: {err}"}
        problems = ["arguments must be an object"] if not isinstance(args, dict) else value_problems(
            args, tool.parameters)
        if problems:
            return "invalid_arguments", {"error": "invalid_arguments", "details": problems}
        real = self.real_servers.get(name)
        if real is not None:  # real tools give real outcomes: no injected faults
            got = await real.acall_tool(name, args)
            return ("real_error" if got.is_error else "real"), _parse_text(got.as_message_content())
        draw_timeout, draw_rate, draw_partial, draw_edge = draws
        if draw_timeout < self.faults.timeout:
            return "timeout", {"error": "timeout", "message": f"{name} did not respond within 30 s"}
        if draw_rate < self.faults.rate_limit:
            return "rate_limited", {"error": "rate_limited", "retry_after_s": rng.randint(1, 30)}
        result, effects = await self._simulate(tool, args, index, rng)
        if draw_edge < self.faults.edge_case:
            return "edge_case", _edge_case(result)  # nothing matched, so nothing changed
        self.state.apply(effects)
        if draw_partial < self.faults.partial:
            return "partial", _partial(result)
        return "ok", result

    async def _simulate(self, tool: Tool, args: dict, index: int, rng: random.Random) -> tuple[Any, list[dict]]:
        if self.model is not None:
            prompt = (f"You are simulating the tool `{tool.name}`: {tool.description}\n"
                      f"Parameters schema: {json.dumps(tool.parameters)}\nReturn schema: {json.dumps(tool.returns)}\n"
                      f"State of the world so far: {self.state.summary()}\nCall arguments: {json.dumps(args)}\n"
                      "Produce a realistic result consistent with the state, and the call's effects on the state "
                      '(op is create, update or delete; key names the record). Answer as JSON: {"result": ..., '
                      f'"effects": [{{"op": "create", "key": "...", "value": ...}}]}}. {JSON_INSTRUCTION}')
            got = await ask_json(self.model, [{"role": "user", "content": prompt}], _effects_validator(tool.returns),
                                 stats=self.stats, max_attempts=self.max_attempts, **self.sampling)
            if got is not None:
                effects = got["effects"] or verb_effects(tool.name, args, got["result"], index)
                return got["result"], effects
            self._count("simulator_fallback")
        result = fake_value(tool.returns or {"type": "object", "properties": {"status": {"enum": ["ok"]}}}, rng,
                            tool.name)
        return result, verb_effects(tool.name, args, result, index)


def _parse_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"text": text}


def _partial(result: Any) -> Any:
    """Keep the first half of every list (at least one item) and say so, as a paginated API would."""
    if isinstance(result, dict):
        out = {k: (v[: max(1, len(v) // 2)] if isinstance(v, list) else v) for k, v in result.items()}
        return {**out, "partial": True, "warning": "result truncated; the service returned partial data"}
    if isinstance(result, list):
        return {"items": result[: max(1, len(result) // 2)], "partial": True}
    return {"result": result, "partial": True}


def _edge_case(result: Any) -> Any:
    """The call matched nothing: lists emptied with a note, or a not-found error when there is no list."""
    if isinstance(result, dict) and any(isinstance(v, list) for v in result.values()):
        return {**{k: ([] if isinstance(v, list) else v) for k, v in result.items()},
                "note": "no matching records found"}
    if isinstance(result, list):
        return {"result": [], "note": "no matching records found"}
    return {"error": "not_found", "message": "no record matches the given arguments"}
