"""`openk2 synth run`: tools -> agents -> tasks -> trajectories -> judged -> SFT JSONL (report 3.1.1, Figure 8).

Stages, each writing to the run directory:

    domains.jsonl      categories evolved into application domains            (key: category)
    synthetic.jsonl    tools synthesized per domain, after schema validation   (key: domain_id)
    tools.jsonl        the repository: MCP + synthetic tools, deduplicated     (rebuilt each run, atomically)
    agents.jsonl       system prompt + sampled toolset per agent               (key: agent_id)
    tasks.jsonl        rubric tasks per agent                                  (key: agent_id)
    coding.jsonl       coding tasks ([coding]) with their hidden tests         (key: task_id)
    trajectories.jsonl one simulated episode per (task, sample)                (key: trajectory_id)
    judged.jsonl       the rubric judge's verdicts per trajectory              (key: trajectory_id)
    sft.jsonl          accepted trajectories: {"messages", "tools", "meta"}    (rebuilt each run, atomically)
    stats.json         counts, acceptance statistics, structured-output failures
    stages.json        per stage: counts, acceptance rate, rejection reasons, dedup, tool-call validity,
                       throughput (`openk2.agentic.stage_stats`; `openk2 synth run` renders it as report.md)

Every work item is appended as soon as it finishes (`JsonlStore`), so an interrupted run started again with the
same config skips what is on disk and does the rest. Within a stage, items run concurrently under asyncio; all
model calls share one semaphore (`run.concurrency`). Randomness (toolsets, personas, fault draws) is keyed by
(seed, item id), so it does not depend on the order items finish in.

A model endpoint that is down after the backend's retries (`openk2.llm.transport`) produces nothing: the item
that needed it is not stored, the stage's other items are cancelled, and the run stops with `EndpointUnreachable`
naming the stage; the same command started again does the pending items.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from openk2.agentic.agents import Agent, Task, make_agent, make_tasks, sample_toolsets
from openk2.agentic.coding import CODE_TOOLS, CodeRunner, CodingProblem, coding_tasks
from openk2.agentic.domains import Domain, evolve_domains, synthesize_tools
from openk2.agentic.jsonout import JSONStats
from openk2.agentic.judge import AcceptanceStats, Judgement, judge_trajectory
from openk2.agentic.mcp_client import MCPServer
from openk2.agentic.rollout import Trajectory, run_episode
from openk2.agentic.simulate import ToolSimulator
from openk2.agentic.stage_stats import stage_stats
from openk2.agentic.store import JsonlStore
from openk2.agentic.synth_config import SynthConfig
from openk2.agentic.tools import Tool, dedup_tools, read_tools, tool_stats, write_tools
from openk2.agentic.users import UserSimulator, pick_persona
from openk2.llm.base import ChatModel
from openk2.llm.transport import EndpointUnreachable, describe, is_transport_error
from openk2.progress import progress_bar

ROLES = ("generator", "agent", "user", "tool_simulator", "judge")


class ThrottledChatModel(ChatModel):
    """A ChatModel whose `achat` waits on a shared semaphore, capping model calls in flight; it counts the calls
    and completion tokens that pass through it (`usage`)."""

    def __init__(self, inner: ChatModel, semaphore: asyncio.Semaphore, usage: Counter | None = None) -> None:
        self.inner = inner
        self.semaphore = semaphore
        self.name = getattr(inner, "name", "model")
        self.usage = usage if usage is not None else Counter()

    def _count(self, replies: list) -> list:
        self.usage["calls"] += 1
        self.usage["completion_tokens"] += int((replies[0].usage or {}).get("completion_tokens", 0)) if replies else 0
        return replies

    def chat(self, messages, tools=None, **sampling):
        return self._count(self.inner.chat(messages, tools, **sampling))

    async def achat(self, messages, tools=None, **sampling):
        async with self.semaphore:
            return self._count(await self.inner.achat(messages, tools, **sampling))


async def run_concurrently(items: Sequence[Any], work: Callable[[Any], Awaitable[None]], desc: str) -> None:
    """`work(item)` for every item at once (the model semaphore does the limiting), with a progress bar; the
    first failure cancels the rest (a transport failure becomes `EndpointUnreachable` naming the stage)."""
    bar = progress_bar(len(items), desc, "item", leave=False)

    async def one(item: Any) -> None:
        await work(item)
        bar.update()

    tasks = [asyncio.ensure_future(one(item)) for item in items]
    try:
        await asyncio.gather(*tasks)
    except Exception as err:
        if is_transport_error(err) and not isinstance(err, EndpointUnreachable):
            raise EndpointUnreachable(f"stage {desc!r}: {describe(err)}") from err
        raise
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()


class SynthPipeline:
    """One synthesis run in `out_dir`; `models` maps roles to ChatModels (else loaded from the config's specs),
    `embed` is the dedup embedder (else MiniLM when `tools.embedding_dedup`)."""

    def __init__(self, cfg: SynthConfig, out_dir: str | Path, models: dict[str, ChatModel | None] | None = None,
                 embed: Callable[[list[str]], Any] | None = None) -> None:
        self.cfg = cfg
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self._check_config()
        self._given_models = models
        self._embed = embed
        self.json_stats = {role: JSONStats() for role in ROLES}
        self._loaded: list[ChatModel] = []  # models this pipeline loaded itself (and so closes)
        self.stage_counts: dict[str, int] = {}
        self.stage_seconds: dict[str, float] = {}  # wall time of each stage in this run
        self.stage_done: dict[str, int] = {}  # items each stage finished in this run
        self.usage = {role: Counter() for role in ROLES}  # model calls and completion tokens per role
        self.prompt_tokens: Counter = Counter()  # prompt tokens of loaded hf models; shared: prefilled once

    def _check_config(self) -> None:
        """Refuse to resume a run directory made with a different config (its stored work would not match)."""
        path = self.out / "config.json"
        mine = {**self.cfg.to_dict(), "run": {**self.cfg.to_dict()["run"], "concurrency": None}}
        if path.exists():
            theirs = json.loads(path.read_text())
            if theirs != json.loads(json.dumps(mine)):
                raise ValueError(f"{self.out} holds a run with a different config; use a new --out directory")
        else:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(mine, indent=2))
            tmp.replace(path)

    def _load_models(self, semaphore: asyncio.Semaphore,
                     roles: Sequence[str] = ROLES) -> dict[str, ChatModel | None]:
        needed = [r for r in roles if r != "tool_simulator"]
        if tuple(roles) == ("generator",) and not self.cfg.tools.categories:
            needed = []  # an MCP-only repository needs no model
        if self._given_models is not None:
            raw = {role: self._given_models.get(role) for role in roles}
        else:
            from openk2.llm.registry import load_chat_model

            cache: dict[str, ChatModel] = {}
            raw = {}
            for role in roles:
                spec = getattr(self.cfg.models, role) if role in needed or role == "tool_simulator" else ""
                if spec and spec not in cache:
                    cache[spec] = load_chat_model(spec)
                raw[role] = cache.get(spec) if spec else None
            self._loaded += list(cache.values())
        missing = [r for r in needed if raw[r] is None]
        if missing:
            raise ValueError(f"no chat model for role(s): {', '.join(missing)}")
        return {role: ThrottledChatModel(m, semaphore, self.usage[role]) if m is not None else None
                for role, m in raw.items()}

    def sampling(self, role: str) -> dict[str, Any]:
        temperature = self.cfg.models.judge_temperature if role == "judge" else self.cfg.models.temperature
        return {"temperature": temperature, "max_tokens": self.cfg.models.tokens_for(role)}

    def run(self) -> dict[str, Any]:
        """Run (or resume) every stage; returns the final statistics (also written to stats.json)."""
        return asyncio.run(self.arun())

    async def arun(self) -> dict[str, Any]:
        start = time.perf_counter()
        servers: list[MCPServer] = []
        try:
            models = self._load_models(asyncio.Semaphore(self.cfg.run.concurrency))
            repo = await self._tool_stages(models["generator"], servers)
            real = {t.name: s for s in servers if s.name in self.cfg.tools.real_execution for t in repo
                    if t.source == "mcp" and t.origin.get("server") == s.name}
            agents = await self._agents(models["generator"], repo)
            tasks = await self._tasks(models["generator"], agents, repo)
            problems = self._coding(agents, tasks)
            await self._episodes(models, agents, tasks, repo + (CODE_TOOLS if problems else []), real, problems)
        except Exception as err:
            if is_transport_error(err):
                raise self._stopped(err) from err
            raise
        finally:
            self._close(servers)
        return self._finish(time.perf_counter() - start)

    async def abuild_tools(self) -> list[Tool]:
        """Only the tool stages (domains, synthetic tools, repository); returns the repository."""
        servers: list[MCPServer] = []
        try:
            generator = self._load_models(asyncio.Semaphore(self.cfg.run.concurrency), roles=("generator",))
            return await self._tool_stages(generator["generator"], servers)
        except Exception as err:
            if is_transport_error(err):
                raise self._stopped(err) from err
            raise
        finally:
            self._close(servers)

    def _stopped(self, err: Exception) -> EndpointUnreachable:
        """The one-line `EndpointUnreachable` for transport failure `err`, saying how to resume."""
        what = str(err) if isinstance(err, EndpointUnreachable) else describe(err)
        return EndpointUnreachable(f"an endpoint could not be reached after its retries ({what}); finished work "
                                   f"is kept in {self.out}: rerun the same command to do the rest")

    def _close(self, servers: list[MCPServer]) -> None:
        for server in servers:
            server.close()
        for model in self._loaded:
            for key, n in getattr(model, "prefix_stats", {}).items():  # hf: prompt tokens, those prefilled once
                self.prompt_tokens[key] += n
            model.close()
        self._loaded = []

    async def _tool_stages(self, generator: ChatModel | None, servers: list[MCPServer]) -> list[Tool]:
        """Start the MCP servers (appended to `servers`, which the caller closes) and build the repository."""
        for command in self.cfg.tools.mcp_servers:
            servers.append(await asyncio.to_thread(MCPServer, command))
        synthetic: list[Tool] = []
        if self.cfg.tools.categories:
            if generator is None:
                raise ValueError("synthetic tools need a generator model (models.generator)")
            synthetic = await self._synthetic_tools(generator, await self._domains(generator))
        return self._repository(servers, synthetic)

    async def _stage(self, name: str, items: Sequence[Any], work: Callable[[Any], Awaitable[None]]) -> None:
        """`run_concurrently` with the stage's wall time and finished items recorded for the report."""
        start = time.perf_counter()
        try:
            await run_concurrently(items, work, name)
        finally:
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + time.perf_counter() - start
            self.stage_done[name] = self.stage_done.get(name, 0) + len(items)

    async def _domains(self, model: ChatModel) -> list[Domain]:
        store = JsonlStore(self.out / "domains.jsonl", "category")

        async def work(category: str) -> None:
            failures: list[str] = []
            got = await evolve_domains(model, category, self.cfg.tools.domains_per_category,
                                       stats=self.json_stats["generator"], max_attempts=self.cfg.run.json_attempts,
                                       failures=failures, **self.sampling("generator"))
            store.append({"category": category, "domains": [d.to_dict() for d in got],
                          "failure": failures[0] if failures else None})

        todo = [c for c in dict.fromkeys(self.cfg.tools.categories) if not store.has(c)]
        await self._stage("domains", todo, work)
        return [Domain.from_dict(d) for c in dict.fromkeys(self.cfg.tools.categories) for d in store.get(c)["domains"]]

    async def _synthetic_tools(self, model: ChatModel, domains: list[Domain]) -> list[Tool]:
        store = JsonlStore(self.out / "synthetic.jsonl", "domain_id")

        async def work(domain: Domain) -> None:
            reasons: list[str] = []
            tools, rejected = await synthesize_tools(model, domain, self.cfg.tools.tools_per_domain,
                                                     stats=self.json_stats["generator"],
                                                     max_attempts=self.cfg.run.json_attempts, reasons=reasons,
                                                     **self.sampling("generator"))
            store.append({"domain_id": domain.domain_id, "tools": [t.to_dict() for t in tools],
                          "rejected": rejected, "reasons": reasons})

        await self._stage("tools", [d for d in domains if not store.has(d.domain_id)], work)
        self.stage_counts["synthetic_rejected_by_schema"] = sum(store.get(d.domain_id)["rejected"] for d in domains)
        return [Tool.from_dict(t) for d in domains for t in store.get(d.domain_id)["tools"]]

    def _repository(self, servers: list[MCPServer], synthetic: list[Tool]) -> list[Tool]:
        mcp = [Tool.from_mcp(spec) for s in servers for spec in s.list_tools()]
        embed = self._embed
        if embed is None and self.cfg.tools.embedding_dedup and len(synthetic) > 1:
            from openk2.data.embed import default_embedder

            embed = default_embedder().encode
        kept, dropped = dedup_tools(mcp + synthetic, embed if self.cfg.tools.embedding_dedup else None,
                                    self.cfg.tools.dedup_threshold)
        write_tools(self.out / "tools.jsonl", kept)
        self.stage_counts["tools_dropped_as_duplicates"] = len(dropped)
        return kept

    async def _agents(self, model: ChatModel, repo: list[Tool]) -> list[Agent]:
        store = JsonlStore(self.out / "agents.jsonl", "agent_id")
        a = self.cfg.agents
        toolsets = sample_toolsets(repo, a.num_agents, a.tools_per_agent, self.cfg.run.seed)
        ids = [f"a{i:04d}" for i in range(a.num_agents)]

        async def work(i: int) -> None:
            domain, tools = toolsets[i]
            agent = await make_agent(model, ids[i], domain, tools, self.cfg.run.seed,
                                     stats=self.json_stats["generator"], max_attempts=self.cfg.run.json_attempts,
                                     **self.sampling("generator"))
            store.append(agent.to_dict())

        await self._stage("agents", [i for i in range(a.num_agents) if not store.has(ids[i])], work)
        return [Agent.from_dict(store.get(i)) for i in ids]

    async def _tasks(self, model: ChatModel, agents: list[Agent], repo: list[Tool]) -> list[Task]:
        store = JsonlStore(self.out / "tasks.jsonl", "agent_id")
        by_name = {t.name: t for t in repo}

        async def work(agent: Agent) -> None:
            tools = [by_name[n] for n in agent.tool_names if n in by_name]
            failures: list[str] = []
            tasks = await make_tasks(model, agent, tools, self.cfg.agents.tasks_per_agent,
                                     stats=self.json_stats["generator"], max_attempts=self.cfg.run.json_attempts,
                                     failures=failures, **self.sampling("generator"))
            store.append({"agent_id": agent.agent_id, "tasks": [t.to_dict() for t in tasks],
                          "failure": failures[0] if failures else None})

        await self._stage("tasks", [a for a in agents if not store.has(a.agent_id)], work)
        return [Task.from_dict(t) for a in agents for t in store.get(a.agent_id)["tasks"]]

    def _coding(self, agents: list[Agent], tasks: list[Task]) -> dict[str, CodingProblem]:
        """Add the coding agent and its tasks (`[coding]`; recorded with their hidden tests in coding.jsonl) to
        `agents` and `tasks`; returns each coding task's problem. Checks first that this machine has the sandbox."""
        if self.cfg.coding.num_tasks == 0:
            return {}
        from openk2.agentic.sandbox import check_sandbox

        check_sandbox()  # SandboxUnavailableError naming the missing layer, before any episode runs
        agent, coding, problems = coding_tasks(self.cfg.run.seed, self.cfg.coding.num_tasks)
        store = JsonlStore(self.out / "coding.jsonl", "task_id")
        for task in coding:
            if not store.has(task.task_id):
                store.append({"task_id": task.task_id, "agent": agent.to_dict(), "task": task.to_dict(),
                              "problem": problems[task.task_id].to_dict()})
        agents.append(agent)
        tasks.extend(coding)
        self.stage_counts["coding_tasks"] = len(coding)
        return problems

    async def _episodes(self, models: dict[str, ChatModel | None], agents: list[Agent], tasks: list[Task],
                        repo: list[Tool], real: dict[str, MCPServer],
                        problems: dict[str, CodingProblem] | None = None) -> None:
        trajectories = JsonlStore(self.out / "trajectories.jsonl", "trajectory_id")
        judged = JsonlStore(self.out / "judged.jsonl", "trajectory_id")
        by_name = {t.name: t for t in repo}
        by_agent = {a.agent_id: a for a in agents}
        sim = self.cfg.simulate
        seed = self.cfg.run.seed

        async def work(item: tuple[Task, str]) -> None:
            task, traj_id = item
            record = trajectories.get(traj_id)
            if record is None:
                agent = by_agent[task.agent_id]
                tools = [by_name[n] for n in agent.tool_names if n in by_name]
                persona = pick_persona(seed, traj_id)
                user = UserSimulator(models["user"], persona, task.instruction, **self.sampling("user"))
                problem = (problems or {}).get(task.task_id)
                code = CodeRunner(problem, pool=pool, timeout_s=self.cfg.coding.timeout_s,
                                  memory_mb=self.cfg.coding.memory_mb) if problem is not None else None
                tool_sim = ToolSimulator(tools, seed=seed, episode_id=traj_id, faults=sim.faults,
                                         model=models["tool_simulator"], real_servers=real, code=code,
                                         world_key=agent.domain, world_rows=sim.world_rows,
                                         stats=self.json_stats["tool_simulator"],
                                         max_attempts=self.cfg.run.json_attempts, **self.sampling("tool_simulator"))
                traj = await run_episode(traj_id, agent, task, tools, models["agent"], user, tool_sim, persona,
                                         max_user_turns=sim.max_user_turns, max_agent_steps=sim.max_agent_steps,
                                         agent_tool_choice=sim.agent_tool_choice,
                                         call_max_tokens=self.cfg.models.call_max_tokens or None,
                                         **self.sampling("agent"))
                record = traj.to_dict()
                trajectories.append(record)
            judgement = await judge_trajectory(models["judge"], task, Trajectory.from_dict(record),
                                               stats=self.json_stats["judge"], max_attempts=self.cfg.run.json_attempts,
                                               **self.sampling("judge"))
            judged.append(judgement.to_dict())

        items = [(t, f"{t.task_id}-s{j}") for t in tasks for j in range(sim.trajectories_per_task)]
        pool = None
        if problems:
            from openk2.agentic.sandbox import SandboxPool

            pool = SandboxPool(self.cfg.coding.max_concurrency)
        try:
            await self._stage("episodes", [it for it in items if not judged.has(it[1])], work)
        finally:
            if pool is not None:
                pool.close()

    def _finish(self, seconds: float) -> dict[str, Any]:
        """Write sft.jsonl (accepted trajectories) and stats.json from what is on disk."""
        trajectories = JsonlStore(self.out / "trajectories.jsonl", "trajectory_id")
        judged = JsonlStore(self.out / "judged.jsonl", "trajectory_id")
        tasks = {t["task_id"]: t for r in JsonlStore(self.out / "tasks.jsonl", "agent_id").records()
                 for t in r["tasks"]}
        acceptance = AcceptanceStats()
        outcomes: Counter = Counter()
        tmp = self.out / "sft.jsonl.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for record in trajectories.records():
                outcomes.update(record.get("outcomes", {}))
                if not judged.has(record["trajectory_id"]):
                    continue
                judgement = Judgement.from_dict(judged.get(record["trajectory_id"]))
                acceptance.add(judgement)
                if judgement.accepted:
                    f.write(json.dumps(sft_record(record, tasks.get(record["task_id"], {}), judgement),
                                       ensure_ascii=False) + "\n")
        tmp.replace(self.out / "sft.jsonl")
        stats = {"tools": tool_stats(read_tools(self.out / "tools.jsonl")),
                 **self.stage_counts,
                 "agents": len(JsonlStore(self.out / "agents.jsonl", "agent_id")),
                 "tasks": len(tasks), "trajectories": len(trajectories),
                 "acceptance": acceptance.as_dict(), "tool_outcomes": dict(outcomes.most_common()),
                 "structured_output_this_run": {r: s.as_dict() for r, s in self.json_stats.items() if s.requests},
                 "seconds_this_run": round(seconds, 1), "prompt_tokens_this_run": dict(self.prompt_tokens)}
        stages = stage_stats(self.out, self.cfg, seconds=dict(self.stage_seconds), done=dict(self.stage_done),
                             usage={r: dict(u) for r, u in self.usage.items() if u},
                             structured=stats["structured_output_this_run"], counts=dict(self.stage_counts),
                             total_seconds=seconds)
        stats["stages"] = stages["stages"]
        for name, record in (("stages.json", stages), ("stats.json", stats)):
            tmp = self.out / f"{name}.tmp"
            tmp.write_text(json.dumps(record, indent=2))
            tmp.replace(self.out / name)
        return stats


def sft_record(trajectory: dict, task: dict, judgement: Judgement) -> dict:
    """One SFT line: OpenAI messages + tools (renderable by `openk2.chat.template.render`) and where it came from."""
    return {"messages": trajectory["messages"], "tools": trajectory["tools"],
            "meta": {"trajectory_id": trajectory["trajectory_id"], "task_id": trajectory["task_id"],
                     "agent_id": trajectory["agent_id"], "difficulty": task.get("difficulty"),
                     "persona": trajectory["persona"]["name"], "judge_score": round(judgement.score, 4)}}
