"""Agents and rubric tasks (report 3.1.1, "Agent Diversification & Rubric Tasks").

An `Agent` is a system prompt plus a toolset sampled from the repository: mostly tools of one domain (so
tasks can chain them) with a few from elsewhere (so the agent must pick the right one). Behaviour traits
vary the system prompts. For each agent a model writes tasks from simple to complex, each paired with a
`Rubric`: success criteria (some mandatory), the expected tool-use pattern and checkpoints, as structured
data a judge can score item by item. Both requests carry a JSON schema (`prompt_schema`, `tasks_schema`; the
expected tools are an enum of the agent's own tools), so local backends decode them under the grammar.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from openk2.agentic.jsonout import JSON_INSTRUCTION, JSONStats, ask_structured
from openk2.agentic.tools import Tool
from openk2.llm.base import ChatModel

BEHAVIOURS = (
    "concise: answers briefly and only calls the tools it needs",
    "thorough: checks results and explains what it did",
    "cautious: confirms destructive actions with the user before taking them",
    "proactive: anticipates follow-up needs and offers next steps",
    "formal: uses a professional tone and structured answers",
)
DIFFICULTIES = ("simple", "moderate", "complex")


@dataclass
class Agent:
    agent_id: str
    system_prompt: str
    tool_names: list[str]
    behaviour: str
    domain: str
    prompt_source: str = "model"  # "template" when the model gave no usable system prompt

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict) -> Agent:
        return cls(**record)


@dataclass
class Criterion:
    criterion_id: str
    description: str
    mandatory: bool = True


@dataclass
class Rubric:
    """What success means for a task: criteria, the tools a good trajectory calls, and checkpoints on the way."""

    criteria: list[Criterion]
    expected_tools: list[str] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    expected_tools_mandatory: bool = True  # a trajectory that never calls one of them fails, whatever the judge says

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict) -> Rubric:
        return cls(criteria=[Criterion(**c) for c in record["criteria"]],
                   expected_tools=list(record.get("expected_tools", [])),
                   checkpoints=list(record.get("checkpoints", [])),
                   expected_tools_mandatory=bool(record.get("expected_tools_mandatory", True)))


@dataclass
class Task:
    task_id: str
    agent_id: str
    difficulty: str
    instruction: str  # what the simulated user wants, in the user's terms
    rubric: Rubric

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict) -> Task:
        return cls(task_id=record["task_id"], agent_id=record["agent_id"], difficulty=record["difficulty"],
                   instruction=record["instruction"], rubric=Rubric.from_dict(record["rubric"]))


def sample_toolsets(tools: Sequence[Tool], num_agents: int, tools_per_agent: int,
                    seed: int) -> list[tuple[str, list[Tool]]]:
    """`num_agents` (anchor domain, toolset) pairs: up to `tools_per_agent - 1` tools from one domain (domains
    taken in turn) plus one tool from another domain. Deterministic in `seed`."""
    if tools_per_agent < 1:
        raise ValueError(f"tools_per_agent must be >= 1, got {tools_per_agent}")
    if not tools:
        raise ValueError("the tool repository is empty; nothing to build agents from")
    by_domain: dict[str, list[Tool]] = defaultdict(list)
    for tool in tools:
        by_domain[tool.domain].append(tool)
    domains = sorted(by_domain)
    out = []
    for i in range(num_agents):
        rng = random.Random(f"{seed}:toolset:{i}")
        anchor = domains[i % len(domains)]
        own = by_domain[anchor]
        chosen = rng.sample(own, min(len(own), max(1, tools_per_agent - 1)))
        others = [t for t in tools if t.domain != anchor]
        if len(chosen) < tools_per_agent and others:
            chosen.append(rng.choice(others))
        out.append((anchor, chosen))
    return out


def _tool_lines(tools: Sequence[Tool]) -> str:
    return "\n".join(f"- {t.name}: {t.description}" for t in tools)


PROMPT_SCHEMA = {"type": "object", "properties": {"system_prompt": {"type": "string", "minLength": 30,
                                                                    "maxLength": 400}},
                 "required": ["system_prompt"]}


def tasks_schema(tool_names: Sequence[str], num_tasks: int) -> dict:
    """The JSON schema of a tasks reply: 1..num_tasks tasks, each with a rubric naming only `tool_names`."""
    criterion = {"type": "object", "properties": {"description": {"type": "string", "minLength": 8, "maxLength": 120},
                                                  "mandatory": {"type": "boolean"}},
                 "required": ["description", "mandatory"]}
    rubric = {"type": "object", "properties": {
        "success_criteria": {"type": "array", "items": criterion, "minItems": 1, "maxItems": 3},
        "expected_tools": {"type": "array", "items": {"enum": list(tool_names)}, "minItems": 1, "maxItems": 3},
        "checkpoints": {"type": "array", "items": {"type": "string", "minLength": 3, "maxLength": 80},
                        "maxItems": 2}},
        "required": ["success_criteria", "expected_tools", "checkpoints"]}
    task = {"type": "object", "properties": {"instruction": {"type": "string", "minLength": 15, "maxLength": 240},
                                             "difficulty": {"enum": list(DIFFICULTIES)}, "rubric": rubric},
            "required": ["instruction", "difficulty", "rubric"]}
    return {"type": "object", "properties": {"tasks": {"type": "array", "items": task, "minItems": 1,
                                                       "maxItems": max(1, num_tasks)}}, "required": ["tasks"]}


def _prompt_validator(value: Any) -> str:
    if isinstance(value, dict) and isinstance(value.get("system_prompt"), str) and len(value["system_prompt"]) > 20:
        return value["system_prompt"].strip()
    raise ValueError('expected {"system_prompt": "..."} with a real prompt')


def template_prompt(domain: str, behaviour: str, tools: Sequence[Tool]) -> str:
    """The system prompt used when the model cannot write one."""
    return (f"You are an assistant for {domain or 'general tasks'}. You are {behaviour}. Use the available "
            f"tools ({', '.join(t.name for t in tools)}) when they help; never invent tool results.")


async def make_agent(model: ChatModel, agent_id: str, domain: str, tools: Sequence[Tool], seed: int, *,
                     stats: JSONStats | None = None, max_attempts: int = 3, **sampling: Any) -> Agent:
    """An agent for a sampled toolset; the model writes its system prompt (a template if it cannot)."""
    behaviour = random.Random(f"{seed}:behaviour:{agent_id}").choice(BEHAVIOURS)
    prompt = (f"Write the system prompt for an AI assistant working in: {domain}.\nIts personality: {behaviour}.\n"
              f"It can call these tools:\n{_tool_lines(tools)}\n"
              f'Answer as JSON: {{"system_prompt": "..."}}. {JSON_INSTRUCTION}')
    reply = await ask_structured(model, [{"role": "user", "content": prompt}], _prompt_validator, stats=stats,
                                 schema=PROMPT_SCHEMA, max_attempts=max_attempts, **sampling)
    system = reply.value if reply.ok else template_prompt(domain, behaviour, tools)
    return Agent(agent_id=agent_id, system_prompt=system, tool_names=[t.name for t in tools], behaviour=behaviour,
                 domain=domain, prompt_source="model" if reply.ok else "template")


_TASK_PLACEHOLDER = "what the user asks for, in their words"


def _tasks_validator(tool_names: set[str], num_tasks: int):
    def validate(value: Any) -> list[dict]:
        if isinstance(value, dict) and isinstance(value.get("tasks"), list):
            value = value["tasks"]
        if not isinstance(value, list):
            raise ValueError('expected {"tasks": [...]}')
        good = []
        for t in value:
            if not isinstance(t, dict) or not isinstance(t.get("instruction"), str) or not t["instruction"].strip():
                continue
            if t["instruction"] == _TASK_PLACEHOLDER:  # the answer template copied back
                continue
            rubric = t.get("rubric") if isinstance(t.get("rubric"), dict) else {}
            criteria = [c for c in rubric.get("success_criteria", []) if isinstance(c, (dict, str))
                        and c not in ("...", {"description": "...", "mandatory": True})]
            expected = [n for n in rubric.get("expected_tools", []) if n in tool_names]
            if criteria and expected:
                good.append({**t, "rubric": {**rubric, "success_criteria": criteria, "expected_tools": expected}})
        if not good:
            raise ValueError("no task has an instruction, success_criteria and expected_tools naming the agent's "
                             f"tools ({', '.join(sorted(tool_names))})")
        return good[:num_tasks]
    return validate


def _rubric(raw: dict) -> Rubric:
    criteria = []
    for k, c in enumerate(raw["success_criteria"], 1):
        desc = c if isinstance(c, str) else str(c.get("description") or c.get("criterion") or "")
        mandatory = True if isinstance(c, str) else bool(c.get("mandatory", True))
        if desc.strip():
            criteria.append(Criterion(criterion_id=f"c{k}", description=desc.strip(), mandatory=mandatory))
    checkpoints = [str(c) for c in raw.get("checkpoints", []) if str(c).strip()]
    return Rubric(criteria=criteria, expected_tools=list(raw["expected_tools"]), checkpoints=checkpoints)


async def make_tasks(model: ChatModel, agent: Agent, tools: Sequence[Tool], num_tasks: int, *,
                     stats: JSONStats | None = None, max_attempts: int = 3, failures: list[str] | None = None,
                     **sampling: Any) -> list[Task]:
    """Up to `num_tasks` tasks for `agent`, from simple to complex, each with a rubric; when the request gives
    up, its reason is appended to `failures`."""
    levels = [DIFFICULTIES[min(len(DIFFICULTIES) - 1, k * len(DIFFICULTIES) // max(1, num_tasks))]
              for k in range(num_tasks)]
    # The shape in words, not an example with values: small models copy example values verbatim.
    shape = ('{"tasks": [{"instruction": the user\'s request in their words, "difficulty": simple|moderate|complex, '
             '"rubric": {"success_criteria": [{"description", "mandatory": true|false}], "expected_tools": [tool '
             'names], "checkpoints": [short states]}}]}')
    prompt = (f"An assistant has this system prompt:\n{agent.system_prompt}\nIts tools:\n{_tool_lines(tools)}\n"
              f"Write {num_tasks} realistic user tasks for it with difficulties {', '.join(levels)} (complex ones "
              "need several tool calls). Give each a rubric: success_criteria (mark the essential ones "
              "mandatory), expected_tools (names from the list, in the order they should be used) and checkpoints "
              f"(intermediate states a good trajectory reaches).\nAnswer as JSON: {shape}. {JSON_INSTRUCTION}")
    reply = await ask_structured(model, [{"role": "user", "content": prompt}],
                                 _tasks_validator({t.name for t in tools}, num_tasks), stats=stats,
                                 schema=tasks_schema([t.name for t in tools], num_tasks),
                                 max_attempts=max_attempts, **sampling)
    if not reply.ok and failures is not None:
        failures.append(f"{reply.reason}: {reply.error}"[:300])
    got = reply.value if reply.ok else None
    tasks = []
    for k, raw in enumerate(got or []):
        rubric = _rubric(raw["rubric"])
        if not rubric.criteria:
            continue
        difficulty = raw.get("difficulty") if raw.get("difficulty") in DIFFICULTIES else levels[k]
        tasks.append(Task(task_id=f"{agent.agent_id}-t{k}", agent_id=agent.agent_id, difficulty=difficulty,
                          instruction=raw["instruction"].strip(), rubric=rubric))
    return tasks
