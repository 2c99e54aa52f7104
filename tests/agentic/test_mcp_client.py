"""Real MCP servers over stdio: mcp-server-time and mcp-server-git listed, real tools called, real execution
inside the tool simulator, and `openk2 synth tools` building an MCP repository."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from openk2.agentic.mcp_client import MCPServer, parse_command
from openk2.agentic.simulate import FaultConfig, ToolSimulator
from openk2.agentic.tools import Tool, read_tools
from openk2.cli.synth import synth_main

TIME = "python -m mcp_server_time --local-timezone UTC"


@pytest.fixture(scope="module")
def time_server():
    with MCPServer(TIME) as server:
        yield server


def test_parse_command():
    assert parse_command("python -m mcp_server_time")[0] == sys.executable
    assert parse_command(["uvx", "mcp-server-git"]) == ["uvx", "mcp-server-git"]
    with pytest.raises(ValueError):
        parse_command("  ")


def test_time_server_lists_and_calls(time_server):
    tools = time_server.list_tools()
    assert [t["function"]["name"] for t in tools] == ["get_current_time", "convert_time"]
    spec = tools[0]
    assert spec["type"] == "function" and spec["function"]["parameters"]["required"] == ["timezone"]
    assert spec["x-mcp"]["server"] == "mcp-server-time" and spec["x-mcp"]["command"] == TIME
    tool = Tool.from_mcp(spec)
    assert tool.source == "mcp" and tool.domain == "mcp-server-time" and "datetime" in tool.returns["properties"]

    result = time_server.call_tool("get_current_time", {"timezone": "Asia/Tokyo"})
    assert not result.is_error
    assert result.structured["timezone"] == "Asia/Tokyo" and result.structured["datetime"].endswith("+09:00")
    converted = time_server.call_tool("convert_time", {"source_timezone": "UTC", "time": "12:00",
                                                        "target_timezone": "Asia/Kolkata"})
    assert converted.structured["target"]["datetime"].split("T")[1].startswith("17:30")
    bad = time_server.call_tool("get_current_time", {"timezone": "Nowhere/Atlantis"})
    assert bad.is_error and "Nowhere/Atlantis" in bad.text


def test_simulator_runs_safe_mcp_tools_for_real(time_server):
    tools = [Tool.from_mcp(s) for s in time_server.list_tools()]
    sim = ToolSimulator(tools, seed=0, episode_id="e", faults=FaultConfig(timeout=1.0),  # faults never hit real tools
                        real_servers={"get_current_time": time_server})
    call = {"id": "c", "function": {"name": "get_current_time", "arguments": json.dumps({"timezone": "UTC"})}}
    got = json.loads(asyncio.run(sim.execute(call)))
    assert got["timezone"] == "UTC" and got["day_of_week"]
    invalid = {"id": "d", "function": {"name": "get_current_time", "arguments": "{}"}}
    assert json.loads(asyncio.run(sim.execute(invalid)))["error"] == "invalid_arguments"  # checked before the call
    assert sim.outcomes == {"real": 1, "invalid_arguments": 1}


def test_git_server_lists_and_calls(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "a.txt").write_text("hello\n")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "first commit"], check=True)
    (repo / "b.txt").write_text("untracked\n")
    with MCPServer(["python", "-m", "mcp_server_git", "--repository", str(repo)]) as server:
        names = server.tool_names()
        assert {"git_status", "git_log", "git_diff", "git_commit"} <= set(names)
        status = server.call_tool("git_status", {"repo_path": str(repo)})
        assert not status.is_error and "b.txt" in status.text
        log = server.call_tool("git_log", {"repo_path": str(repo)})
        assert "first commit" in log.text


def test_bad_server_is_a_value_error():
    with pytest.raises(ValueError, match="failed to start"):
        MCPServer("python -c 'import sys; sys.exit(3)'", timeout_s=20)


def test_synth_tools_cli_mcp_only(tmp_path, capsys):
    out = tmp_path / "tools.jsonl"
    assert synth_main(["tools", "--no-synthetic", "--mcp", TIME, "--out", str(out),
                       "--set", "tools.embedding_dedup=false"]) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["name"] for r in records] == ["get_current_time", "convert_time"]
    assert all(r["source"] == "mcp" for r in records)
    assert [t.name for t in read_tools(out)] == ["get_current_time", "convert_time"]
    assert "2 tools: 2 mcp" in capsys.readouterr().out
