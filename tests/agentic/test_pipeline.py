"""`openk2 synth run` end to end: a deterministic scripted model for the logic (counts, filtering, resume) and
the real SmolLM2-135M (hf:smollm2) with a real MCP server for the plumbing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from openk2.agentic.pipeline import ROLES, SynthPipeline
from openk2.agentic.synth_config import SynthConfig
from openk2.chat.template import render, render_with_mask
from openk2.cli.synth import synth_main
from tests.agentic.fake_models import ScriptedModel

TINY = {"tools": {"mcp_servers": [], "categories": ["financial trading", "robot control"], "domains_per_category": 2,
                  "tools_per_domain": 3, "embedding_dedup": False},
        "agents": {"num_agents": 3, "tools_per_agent": 3, "tasks_per_agent": 2},
        "simulate": {"max_user_turns": 2, "max_agent_steps": 6},
        "run": {"seed": 0, "concurrency": 3}}


def _cfg(**changes) -> SynthConfig:
    raw = json.loads(json.dumps(TINY))
    for section, values in changes.items():
        raw.setdefault(section, {}).update(values)
    return SynthConfig.from_dict(raw)


def _models(**kw) -> dict:
    return {role: ScriptedModel(**kw) for role in ROLES}


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_pipeline_end_to_end_with_scripted_model(tmp_path):
    stats = SynthPipeline(_cfg(), tmp_path, _models()).run()
    # 2 categories x 2 domains x (2 valid tools + 1 malformed, rejected by schema validation)
    assert stats["tools"]["total"] == 8 and stats["synthetic_rejected_by_schema"] == 4
    assert stats["agents"] == 3 and stats["tasks"] == 6 and stats["trajectories"] == 6
    assert stats["acceptance"] == {"judged": 6, "accepted": 6, "rejected": 0, "acceptance_rate": 1.0,
                                   "rejections_by_item": {}}
    sft = _lines(tmp_path / "sft.jsonl")
    assert len(sft) == 6
    for record in sft:
        assert set(record) == {"messages", "tools", "meta"}
        text = render(record["messages"], record["tools"], add_generation_prompt=False)
        assert "<|tool_calls_section_begin|>" in text and "## Return of " in text
        assert any(is_assistant for _, is_assistant in render_with_mask(record["messages"], record["tools"]))
        assert record["messages"][-1]["role"] == "assistant"
        names = {t["function"]["name"] for t in record["tools"]}
        called = {c["function"]["name"] for m in record["messages"] for c in m.get("tool_calls") or []}
        assert called == names  # the scripted agent calls each of its tools once
    for name in ("domains", "synthetic", "tools", "agents", "tasks", "trajectories", "judged"):
        assert (tmp_path / f"{name}.jsonl").stat().st_size > 0
    assert json.loads((tmp_path / "stats.json").read_text()) == stats


def test_acceptance_report_at_every_stage(tmp_path, capsys):
    stats = SynthPipeline(_cfg(), tmp_path, _models()).run()
    st = stats["stages"]
    assert st["domains"] == {"requests": 2, "asked": 4, "produced": 4, "acceptance_rate": 1.0, "rejections": {}}
    tools = st["tools"]
    assert (tools["proposed"], tools["valid"], tools["acceptance_rate"]) == (12, 8, 0.6667)
    assert sum(tools["rejections"].values()) == 4 and any("name" in r for r in tools["rejections"])
    assert tools["dropped_as_duplicates"] == 0 and tools["repository"] == 8
    assert st["agents"]["produced"] == 3 and st["agents"]["acceptance_rate"] == 1.0
    assert (st["tasks"]["asked"], st["tasks"]["produced"]) == (6, 6)
    traj = st["trajectories"]
    assert traj["produced"] == 6 and traj["tool_calls"] > 0 and traj["tool_call_validity"] == 1.0
    sources = traj["result_sources"]  # every call answered by the world or an injected fault, none by a model
    assert set(sources) <= {"world", "injected_fault"} and sum(sources.values()) == traj["tool_calls"]
    assert sources["world"] > 0
    assert st["judged"] == {"judged": 6, "accepted": 6, "acceptance_rate": 1.0, "rejections": {}, "model_skipped": 0}
    stages = json.loads((tmp_path / "stages.json").read_text())
    assert stages["usage"]["judge"]["calls"] == 6 and stages["throughput"]["episodes"]["items"] == 6
    assert synth_main(["report", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "| judged | 6 | 6 | 100.0% |" in report and "tool-call validity 100.0%" in report
    for plot in ("funnel.png", "rejections.png"):
        assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no synthesis run"):
        synth_main(["report", "--out", str(tmp_path / "nothing")])
    (tmp_path / "stages.json").unlink()  # an interrupted run: the counts come from the stores
    assert synth_main(["report", "--out", str(tmp_path)]) == 0
    assert "| judged | 6 | 6 | 100.0% |" in (tmp_path / "report.md").read_text()


def test_pipeline_drops_trajectories_failing_a_mandatory_item(tmp_path):
    models = _models()
    models["judge"] = ScriptedModel(fail_criterion="c1")
    stats = SynthPipeline(_cfg(agents={"num_agents": 2}), tmp_path, models).run()
    assert stats["acceptance"]["accepted"] == 0 and stats["acceptance"]["rejections_by_item"] == {"c1": 4}
    assert (tmp_path / "sft.jsonl").read_text() == ""
    judged = _lines(tmp_path / "judged.jsonl")
    assert all(not j["accepted"] and j["failed_mandatory"] == ["c1"] for j in judged)


def test_structured_output_retries_are_bounded_and_counted(tmp_path):
    stats = SynthPipeline(_cfg(run={"json_attempts": 2}), tmp_path / "two", _models(bad_json_first=True)).run()
    assert stats["acceptance"]["accepted"] == 6  # every first reply was junk; every retry worked
    for role in ("generator", "judge"):
        counts = stats["structured_output_this_run"][role]
        assert counts["attempts"] == 2 * counts["requests"] and counts["failures"] == {"no_json": counts["requests"]}
    with pytest.raises(ValueError, match="tool repository is empty"):  # one attempt each: nothing survives
        SynthPipeline(_cfg(run={"json_attempts": 1}), tmp_path / "one", _models(bad_json_first=True)).run()


class Crash(BaseException):
    """Stands for the process dying (not an Exception, so nothing inside the pipeline swallows it)."""


class CrashingJudge(ScriptedModel):
    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after

    def chat(self, messages, tools=None, **sampling):
        if len(self.calls) >= self.after:
            raise Crash()
        return super().chat(messages, tools, **sampling)


class CrashingAgent(ScriptedModel):
    """Dies as soon as it is asked to act on any agent's second task, so those episodes never reach the disk."""

    def chat(self, messages, tools=None, **sampling):
        if tools is not None and "(task 1)" in messages[1]["content"]:
            raise Crash()
        return super().chat(messages, tools, **sampling)


def _episodes_started(model: ScriptedModel) -> int:
    return sum(1 for c in model.calls if "role-playing" in c["messages"][0]["content"]
               and not any(m["role"] == "assistant" for m in c["messages"][1:]))


def _ids(path: Path) -> list[str]:
    return [r["trajectory_id"] for r in _lines(path)] if path.exists() else []


def test_resume_does_not_redo_or_lose_work(tmp_path):
    cfg = _cfg()
    first = _models()
    first["agent"] = CrashingAgent()
    with pytest.raises(Crash):  # dies mid-episodes
        SynthPipeline(cfg, tmp_path, first).run()
    stored = _ids(tmp_path / "trajectories.jsonl")
    assert len(stored) < 6 and not any("-t1-" in t for t in stored)

    second = _models()
    second["judge"] = CrashingJudge(after=2)
    with pytest.raises(Crash):  # dies while judging
        SynthPipeline(cfg, tmp_path, second).run()
    assert len(second["generator"].calls) == 0  # domains, tools, agents and tasks were all on disk
    assert _episodes_started(second["user"]) == 6 - len(stored)  # stored episodes are not played again
    assert _ids(tmp_path / "trajectories.jsonl")[:len(stored)] == stored  # and not lost
    judged_before = _ids(tmp_path / "judged.jsonl")
    with open(tmp_path / "judged.jsonl", "a") as f:
        f.write('{"trajectory_id": "a0002-t1-s0", "verd')  # a line cut off by the crash

    stored = _ids(tmp_path / "trajectories.jsonl")
    third = _models()
    stats = SynthPipeline(cfg, tmp_path, third).run()
    assert _episodes_started(third["user"]) == 6 - len(stored)
    assert len(third["judge"].calls) == 6 - len(judged_before)  # judged ones are not judged again
    trajectories, judged = _ids(tmp_path / "trajectories.jsonl"), _ids(tmp_path / "judged.jsonl")
    assert len(trajectories) == len(set(trajectories)) == 6 and sorted(judged) == sorted(trajectories)
    assert judged[:len(judged_before)] == judged_before
    assert stats["acceptance"]["accepted"] == 6 and len(_lines(tmp_path / "sft.jsonl")) == 6

    fourth = _models()
    SynthPipeline(cfg, tmp_path, fourth).run()  # everything done: no model is called at all
    assert sum(len(m.calls) for m in fourth.values()) == 0
    with pytest.raises(ValueError, match="different config"):
        SynthPipeline(_cfg(agents={"num_agents": 4}), tmp_path, _models())


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown key"):
        SynthConfig.from_dict({"agents": {"num_agent": 3}})
    with pytest.raises(ValueError, match="unknown section"):
        SynthConfig.from_dict({"agent": {}})
    with pytest.raises(ValueError, match="must be >= 1"):
        SynthConfig.from_dict({"run": {"concurrency": 0}})
    with pytest.raises(ValueError, match="fault probability"):
        SynthConfig.from_dict({"simulate": {"faults": {"timeout": 2}}})


@pytest.mark.slow
def test_pipeline_with_smollm2_and_real_mcp(tmp_path):
    """SmolLM2-135M plays every role with a real clock server; its output is poor, so this checks the plumbing:
    every stage ran, every record is well-formed, and judged trajectories are accepted or rejected for a reason."""
    config = tmp_path / "synth.toml"
    config.write_text("""
[models]
max_tokens = 40
[tools]
mcp_servers = ["python -m mcp_server_time --local-timezone UTC"]
categories = ["travel"]
domains_per_category = 1
tools_per_domain = 1
[agents]
num_agents = 2
tools_per_agent = 2
tasks_per_agent = 1
[simulate]
max_user_turns = 1
max_agent_steps = 2
[run]
json_attempts = 1
""")
    out = tmp_path / "run"
    out.mkdir()
    # Agent a0000 and its two tasks are given (a 135M model rarely writes a usable rubric); a0001 is generated.
    agent = {"agent_id": "a0000", "system_prompt": "You tell the time. Use get_current_time.",
             "tool_names": ["get_current_time"], "behaviour": "concise", "domain": "mcp-server-time"}
    (out / "agents.jsonl").write_text(json.dumps(agent) + "\n")
    rubric = {"criteria": [{"criterion_id": "c1", "description": "states the time", "mandatory": True}],
              "expected_tools": ["get_current_time"], "checkpoints": []}
    tasks = [{"task_id": f"a0000-t{k}", "agent_id": "a0000", "difficulty": "simple",
              "instruction": f"What time is it in {city}?", "rubric": rubric}
             for k, city in enumerate(["Tokyo", "Paris"])]
    (out / "tasks.jsonl").write_text(json.dumps({"agent_id": "a0000", "tasks": tasks}) + "\n")

    start = time.perf_counter()
    assert synth_main(["run", "--config", str(config), "--out", str(out)]) == 0
    seconds = time.perf_counter() - start
    stats = json.loads((out / "stats.json").read_text())
    assert stats["tools"]["by_source"]["mcp"] == 2
    assert stats["agents"] == 2 and stats["tasks"] >= 2 and stats["trajectories"] == stats["tasks"]
    judged = _lines(out / "judged.jsonl")
    assert len(judged) == stats["tasks"]
    for j in judged:
        assert isinstance(j["accepted"], bool) and j["accepted"] == (not j["failed_mandatory"])
    for traj in _lines(out / "trajectories.jsonl"):
        assert traj["messages"][0]["role"] == "system"
        no_opening = traj["end_reason"].startswith("user_rejected") and len(traj["messages"]) == 1  # user_check
        assert no_opening or traj["messages"][1]["role"] == "user"
        render(traj["messages"], traj["tools"])  # well-formed chat, whatever the quality
    for record in _lines(out / "sft.jsonl"):
        render(record["messages"], record["tools"])
    assert stats["acceptance"]["judged"] == len(judged)
    print(f"smollm2 pipeline: {seconds:.1f} s, stats: {json.dumps(stats['acceptance'])}, "
          f"outcomes: {stats['tool_outcomes']}")


def test_result_sources_bucket_every_outcome():
    from openk2.agentic.stage_stats import result_sources

    got = result_sources({"ok": 3, "not_found": 1, "partial": 1, "real": 1, "real_error": 1, "timeout": 2,
                          "invalid_arguments": 1, "tests_failed": 1, "phrasing_rejected": 5})
    assert got == {"world": 5, "real_server": 2, "injected_fault": 2, "rejected_call": 1, "sandbox": 1}
