"""Tool repository: schema validation of synthetic tools, domain evolution, embedding dedup, JSONL and stats."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from openk2.agentic.domains import SEED_CATEGORIES, Domain, evolve_domains, synthesize_tools, tools_schema
from openk2.agentic.jsonout import JSONStats
from openk2.agentic.tools import (
    Tool,
    dedup_tools,
    read_tools,
    synthetic_tool,
    tool_problems,
    tool_stats,
    write_tools,
)
from openk2.cli.synth import synth_main
from tests.agentic.fake_models import ScriptedModel

GOOD = {"name": "place_limit_order", "description": "Place a limit order for a stock.",
        "parameters": {"type": "object", "properties": {
            "symbol": {"type": "string", "description": "ticker"},
            "price": {"type": "number", "description": "limit price"}}, "required": ["symbol", "price"]},
        "returns": {"type": "object", "properties": {"order_id": {"type": "string"}}}}


def _with(**changes):
    spec = json.loads(json.dumps(GOOD))
    spec.update(changes)
    return spec


def test_valid_tool_passes():
    assert tool_problems(GOOD) == []
    tool = synthetic_tool(GOOD, category="financial trading", domain="equities", origin={"model": "m"})
    assert tool.source == "synthetic" and tool.to_openai()["function"]["name"] == "place_limit_order"


@pytest.mark.parametrize("bad,expect", [
    (_with(name="place order!"), "name"),
    (_with(name="x"), "name"),
    (_with(description="Order."), "description"),
    (_with(parameters={"type": "array"}), "type 'object'"),
    (_with(parameters={"type": "object", "properties": {"symbol": {"description": "ticker"}}}), "has no type"),
    (_with(parameters={"type": "object", "properties": {"symbol": {"type": "string"}}}), "has no description"),
    (_with(parameters={"type": "object", "properties": {}, "required": ["symbol"]}), "undefined properties"),
    (_with(parameters={"type": "object", "properties": {"n": {"type": "int", "description": "n"}}}), "not a JSON type"),
    (_with(returns="a string"), "returns"),
    ("not a dict", "must be an object"),
])
def test_malformed_tools_are_rejected(bad, expect):
    problems = tool_problems(bad)
    assert problems and any(expect in p for p in problems), problems
    with pytest.raises(ValueError):
        synthetic_tool(bad, category="c", domain="d", origin={})


def test_domain_evolution_and_tool_synthesis_with_fake_model():
    model = ScriptedModel(bad_json_first=True)
    stats = JSONStats()
    domains = asyncio.run(evolve_domains(model, SEED_CATEGORIES[0], 2, stats=stats))
    assert [d.name for d in domains] == ["financial trading alerts", "financial trading reports"]
    tools, rejected = asyncio.run(synthesize_tools(model, domains[0], 3, stats=stats))
    assert [t.name for t in tools] == ["create_financial_trading_alerts_item", "list_financial_trading_alerts_items"]
    assert rejected == 1  # the malformed third tool
    assert all(t.category == "financial trading" and t.domain == "financial trading alerts" for t in tools)
    assert tools[0].origin == {"model": "scripted", "domain_id": "financial trading/financial trading alerts"}
    assert stats.failures == {"no_json": 2} and stats.succeeded == 2  # first replies were junk, retried


def test_report_seed_categories():
    assert {"financial trading", "software apps", "robot control"} <= set(SEED_CATEGORIES)


def _synth(name, description, domain="d"):
    return Tool(name=name, description=description, source="synthetic", domain=domain,
                parameters={"type": "object", "properties": {"city": {"type": "string"}}})


def test_embedding_dedup_with_minilm():
    from openk2.data.embed import default_embedder

    mcp = Tool(name="get_current_time", description="Get current time in a specific timezone", source="mcp",
               parameters={"type": "object", "properties": {"timezone": {"type": "string"}}})
    tools = [_synth("get_weather", "Get the current weather forecast for a city"),
             _synth("fetch_weather", "Fetch the current weather forecast for a city"),  # near-duplicate
             _synth("book_flight", "Book a flight between two airports on a date"),
             _synth("get_weather", "Weather again under the same name"),  # exact name clash
             _synth("current_time_in_zone", "Get the current time in a specific timezone"),  # duplicates MCP
             mcp]
    kept, dropped = dedup_tools(tools, default_embedder().encode, threshold=0.85)
    assert [t.name for t in kept] == ["get_current_time", "get_weather", "book_flight"]
    assert sorted(t.name for t in dropped) == ["current_time_in_zone", "fetch_weather", "get_weather"]
    kept_strict, _ = dedup_tools(tools, default_embedder().encode, threshold=0.999)
    assert len(kept_strict) == 5  # only the name clash goes at a near-1 threshold
    kept_names, _ = dedup_tools(tools, None)
    assert len(kept_names) == 5
    with pytest.raises(ValueError):
        dedup_tools(tools, None, threshold=0.0)


def test_jsonl_roundtrip_stats_and_cli(tmp_path, capsys):
    tools = [synthetic_tool(GOOD, category="financial trading", domain="equities", origin={"model": "m"}),
             Tool.from_mcp({"type": "function", "function": {"name": "get_current_time", "description": "now",
                                                               "parameters": {"type": "object"}},
                            "x-mcp": {"server": "mcp-server-time", "command": "python -m mcp_server_time"}})]
    path = tmp_path / "tools.jsonl"
    assert write_tools(path, tools) == 2
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["source"] for x in lines] == ["synthetic", "mcp"]
    assert read_tools(path) == tools
    stats = tool_stats(tools)
    assert stats["by_source"] == {"synthetic": 1, "mcp": 1}
    assert {"source": "mcp", "domain": "mcp-server-time", "tools": 1} in stats["by_domain"]
    assert synth_main(["tools", "--stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 tools: 1 synthetic, 1 mcp" in out and "equities" in out
    (tmp_path / "bad.jsonl").write_text('{"name": "x"}\n')
    with pytest.raises(ValueError):
        read_tools(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError):
        synth_main(["tools"])


def test_domain_record_roundtrip():
    d = Domain("robot control", "warehouse arms", "pick and place")
    assert Domain.from_dict(d.to_dict()) == d and d.domain_id == "robot control/warehouse arms"


def test_copied_answer_template_is_not_a_domain():
    from openk2.llm.base import ChatModel, ChatResponse

    class Parrot(ChatModel):
        def chat(self, messages, tools=None, **sampling):
            return [ChatResponse(content='{"domains": [{"name": "short domain name", "description": "one sentence"}]}')]

    stats = JSONStats()
    assert asyncio.run(evolve_domains(Parrot(), "travel", 2, stats=stats, max_attempts=2)) == []
    assert stats.failures == {"invalid": 2}


def test_tools_schema_patterns_hold_what_tool_problems_checks():
    """The grammar's string patterns admit only descriptions `tool_problems` accepts (3+ words; a parameter
    description that is not blank)."""
    tool = tools_schema(2)["properties"]["tools"]["items"]["properties"]
    sentence = tool["description"]["pattern"]
    param = tool["parameters"]["properties"]["properties"]["additionalProperties"]["properties"]["description"]
    for text, ok in (("Look up an order by id.", True), ("Too short", False), ("two  spaces here", False),
                     (" Leading space is out", False), ("x " * 30 + "end", False)):
        assert bool(re.search(sentence, text)) is ok, text
    assert re.search(param["pattern"], "the order id") and not re.search(param["pattern"], "   ")
    record = {"name": "get_order", "description": "Look up an order by id.", "returns": {"type": "object"},
              "parameters": {"type": "object", "properties": {"order_id": {"type": "string",
                                                                           "description": "the order id"}}}}
    assert tool_problems(record) == []
