"""`openk2 synth run` configuration: one TOML file, one section per pipeline stage (configs/synth-tiny.toml).

Each section maps onto a keyword-only dataclass; an unknown key or a value of the wrong type is a ValueError
naming it and its file. `base = "x.toml"` inheritance and `--set section.key=value` overrides work as for
training runs (`openk2.configfile`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openk2.agentic.domains import SEED_CATEGORIES
from openk2.agentic.rollout import AGENT_TOOL_CHOICES
from openk2.agentic.simulate import FaultConfig
from openk2.configfile import build_section, check_keys, check_table, load_config


@dataclass(kw_only=True)
class ModelsSection:
    """ChatModel specs (`hf:smollm2`, `local:DIR`, `openai:URL#MODEL`) per role; one load per distinct spec."""

    generator: str = "hf:smollm2"  # domains, tools, agent prompts, tasks
    agent: str = "hf:smollm2"  # the model whose trajectories become SFT data (a strong one in real use)
    user: str = "hf:smollm2"  # user simulator
    tool_simulator: str = "hf:smollm2"  # "" = no model: tool results come from the seeded schema faker
    judge: str = "hf:smollm2"
    temperature: float = 0.7
    max_tokens: int = 512
    judge_temperature: float = 0.0
    # per-role budgets (0: max_tokens); constrained replies always close within 2x their schema's reserve
    generator_max_tokens: int = 0
    agent_max_tokens: int = 0
    user_max_tokens: int = 0
    judge_max_tokens: int = 0
    call_max_tokens: int = 0  # an agent turn decoded as a forced tool call (tool_choice "required"); 0: agent's

    def tokens_for(self, role: str) -> int:
        """The completion budget of `role`."""
        return getattr(self, f"{role}_max_tokens", 0) or self.max_tokens


@dataclass(kw_only=True)
class ToolsSection:
    mcp_servers: list[str] = field(default_factory=lambda: ["python -m mcp_server_time --local-timezone UTC"])
    real_execution: list[str] = field(default_factory=lambda: ["mcp-server-time"])  # servers safe to run for real
    categories: list[str] = field(default_factory=lambda: list(SEED_CATEGORIES[:3]))
    domains_per_category: int = 2
    tools_per_domain: int = 3
    dedup_threshold: float = 0.85  # cosine similarity at which a synthetic tool counts as a duplicate
    embedding_dedup: bool = True  # False: dedup by name only (no MiniLM)


@dataclass(kw_only=True)
class AgentsSection:
    num_agents: int = 4
    tools_per_agent: int = 3
    tasks_per_agent: int = 2


@dataclass(kw_only=True)
class SimulateSection:
    trajectories_per_task: int = 1
    max_user_turns: int = 2
    max_agent_steps: int = 6
    world_rows: int = 5  # seeded entities per kind in each episode's world (openk2.agentic.world)
    # when the task expects tools: "auto" | "required_first" (first agent turn must call a tool) | "required"
    # (every turn until each expected tool was called); see openk2.agentic.rollout
    agent_tool_choice: str = "auto"
    faults: FaultConfig = field(default_factory=FaultConfig)


@dataclass(kw_only=True)
class CodingSection:
    """Coding episodes (openk2.agentic.coding): procedural problems whose hidden tests run in the sandbox."""

    num_tasks: int = 0  # 0: none; else a coding agent with run_code/run_tests and this many tasks
    timeout_s: float = 10.0  # wall clock per sandboxed run
    memory_mb: int = 256
    max_concurrency: int = 2  # sandboxed runs at once, over all episodes


@dataclass(kw_only=True)
class RunSection:
    seed: int = 0
    concurrency: int = 8  # model calls in flight at once, over all roles
    json_attempts: int = 3  # tries per structured-output request


@dataclass(kw_only=True)
class SynthConfig:
    models: ModelsSection = field(default_factory=ModelsSection)
    tools: ToolsSection = field(default_factory=ToolsSection)
    agents: AgentsSection = field(default_factory=AgentsSection)
    simulate: SimulateSection = field(default_factory=SimulateSection)
    run: RunSection = field(default_factory=RunSection)
    coding: CodingSection = field(default_factory=CodingSection)

    def __post_init__(self) -> None:
        positive = {"agents.num_agents": self.agents.num_agents, "agents.tools_per_agent": self.agents.tools_per_agent,
                    "agents.tasks_per_agent": self.agents.tasks_per_agent, "run.concurrency": self.run.concurrency,
                    "run.json_attempts": self.run.json_attempts, "models.max_tokens": self.models.max_tokens,
                    "simulate.trajectories_per_task": self.simulate.trajectories_per_task,
                    "simulate.max_user_turns": self.simulate.max_user_turns,
                    "simulate.max_agent_steps": self.simulate.max_agent_steps}
        for key, value in positive.items():
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        budgets = ("generator", "agent", "user", "judge", "call")
        if any(getattr(self.models, f"{r}_max_tokens") < 0 for r in budgets):
            raise ValueError("models.<role>_max_tokens must be >= 0 (0: models.max_tokens)")
        if self.simulate.world_rows < 0 or self.coding.num_tasks < 0:
            raise ValueError("simulate.world_rows and coding.num_tasks must be >= 0")
        if self.simulate.agent_tool_choice not in AGENT_TOOL_CHOICES:
            raise ValueError(f"simulate.agent_tool_choice must be one of {AGENT_TOOL_CHOICES}, "
                             f"got {self.simulate.agent_tool_choice!r}")
        if self.coding.max_concurrency < 1:
            raise ValueError(f"coding.max_concurrency must be >= 1, got {self.coding.max_concurrency}")
        if not 0.0 < self.tools.dedup_threshold <= 1.0:
            raise ValueError(f"tools.dedup_threshold must be in (0, 1], got {self.tools.dedup_threshold}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SynthConfig:
        raw = dict(raw)
        sections = {"models": ModelsSection, "tools": ToolsSection, "agents": AgentsSection, "run": RunSection,
                    "coding": CodingSection}
        check_keys(raw, [*sections, "simulate"], "unknown section(s) in synth config")
        built = {name: build_section(cls_, name, raw.get(name, {})) for name, cls_ in sections.items()}
        check_table(SimulateSection, "simulate", raw.get("simulate", {}))
        sim = dict(raw.get("simulate", {}))
        faults = build_section(FaultConfig, "simulate.faults", sim.pop("faults", {}))
        built["simulate"] = build_section(SimulateSection, "simulate", {**sim, "faults": faults})
        return cls(**built)


def load_synth_config(path: str | Path | None, overrides: list[str] | None = None) -> SynthConfig:
    """Read a synth TOML config (defaults when `path` is None) and apply `section.key=value` overrides; a bad key
    or value is a ValueError naming it and its file or `--set`."""
    return load_config(path, overrides, SynthConfig.from_dict)
