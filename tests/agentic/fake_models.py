"""A deterministic stand-in for every model role of the synthesis pipeline, routed by what the prompt asks.

It answers the way a competent model would (valid JSON for generation, simulation and judging; a user who asks
once and then ends; an agent that calls each tool once and then answers), so the pipeline's logic can be tested
exactly. Knobs make it misbehave on purpose: `fail_criterion` makes the judge fail that rubric item,
`bad_json_first` makes the first reply of every structured request unparseable, and `skip_tools` makes the
agent answer without calling any tool.
"""

from __future__ import annotations

import copy
import json
import random
import re

from openk2.agentic.simulate import fake_value
from openk2.llm.base import ChatModel, ChatResponse


def _tool(name: str, description: str, param: str) -> dict:
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": {param: {"type": "string", "description": f"the {param}"}},
                           "required": [param]},
            "returns": {"type": "object", "properties": {"status": {"type": "string"},
                                                         "items": {"type": "array", "items": {"type": "string"}}}}}


class ScriptedModel(ChatModel):
    name = "scripted"

    def __init__(self, fail_criterion: str | None = None, bad_json_first: bool = False,
                 skip_tools: bool = False) -> None:
        self.fail_criterion = fail_criterion
        self.bad_json_first = bad_json_first
        self.skip_tools = skip_tools
        self.calls: list[dict] = []

    def chat(self, messages, tools=None, **sampling):
        self.calls.append({"messages": copy.deepcopy(list(messages)), "tools": tools, "sampling": sampling})
        text = messages[0].get("content") or ""
        retry = len(messages) > 1 and messages[-1]["role"] == "user" and "cannot be used" in messages[-1]["content"]
        if self.bad_json_first and "JSON" in messages[-1]["content"] and not retry and tools is None \
                and "role-playing" not in text:
            return [ChatResponse(content="Sure! Here it comes: {not json", finish_reason="stop")]
        if tools is not None:
            return [self._agent(messages, tools)]
        if "role-playing a user" in text:
            said = sum(m["role"] == "assistant" for m in messages)
            goal = text.split("Your goal: ", 1)[1].split("\n", 1)[0]
            return [ChatResponse(content=f"Hi, please help: {goal}" if said == 0 else "[END]")]
        return [ChatResponse(content=self._structured(text), finish_reason="stop")]

    def _structured(self, text: str) -> str:
        if "application domains" in text:
            cat = re.search(r"Category: (.*)\n", text).group(1)
            return json.dumps({"domains": [{"name": f"{cat} alerts", "description": "Alerts on changes."},
                                           {"name": f"{cat} reports", "description": "Periodic reports."}]})
        if "specialised tools" in text:
            domain = re.search(r"Domain: (.*?) \(", text).group(1).replace(" ", "_")
            tools = [_tool(f"create_{domain}_item", f"Create a new item in {domain}.", "title"),
                     _tool(f"list_{domain}_items", f"List the items of {domain} matching a query.", "query"),
                     {"name": "1bad name", "description": "x", "parameters": {"type": "string"}}]
            return "Here you go:\n```json\n" + json.dumps({"tools": tools}) + "\n```"
        if "Write the system prompt" in text:
            return json.dumps({"system_prompt": "You are a careful assistant. Use tools to act for the user."})
        if "realistic user tasks" in text:
            names = re.findall(r"^- (\w+):", text, re.M)
            n = int(re.search(r"Write (\d+) realistic", text).group(1))
            tasks = [{"instruction": f"Please use {names[k % len(names)]} for me (task {k}).", "difficulty": "simple",
                      "rubric": {"success_criteria": [{"description": "the request is fulfilled", "mandatory": True},
                                                      {"description": "the answer is polite", "mandatory": False}],
                                 "expected_tools": [names[k % len(names)]], "checkpoints": ["tool called"]}}
                     for k in range(n)]
            return json.dumps({"tasks": tasks})
        if "You are simulating the tool" in text:
            name = re.search(r"simulating the tool `(\w+)`", text).group(1)
            return json.dumps({"result": {"status": "ok", "items": ["a", "b", "c", "d"]},
                               "effects": [{"op": "create", "key": f"{name}-record", "value": {"ok": True}}]})
        if "strict judge" in text:
            ids = re.findall(r'"id": "(c\d+)"', text)
            return json.dumps({"verdicts": [{"id": i, "passed": i != self.fail_criterion, "reason": "checked"}
                                            for i in ids]})
        return "I do not understand."

    def _agent(self, messages, tools) -> ChatResponse:
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        called = {c["function"]["name"] for m in messages[last_user:] if m["role"] == "assistant"
                  for c in m.get("tool_calls") or []}
        todo = [t["function"] for t in tools if t["function"]["name"] not in called]
        if todo and not self.skip_tools:
            fn = todo[0]
            args = fake_value(fn["parameters"], random.Random(0), "arg")
            if "timezone" in args:
                args["timezone"] = "Europe/Paris"
            call = {"id": f"call_{len(messages)}", "type": "function",
                    "function": {"name": fn["name"], "arguments": json.dumps(args)}}
            return ChatResponse(content=None, tool_calls=[call], finish_reason="tool_calls")
        return ChatResponse(content="All done: I used the tools and here is the result.", finish_reason="stop")
