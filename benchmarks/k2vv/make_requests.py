"""Write benchmarks/k2vv/requests.jsonl: ~100 real-shaped tool-use chat requests, deterministically (seed 0).

Each line is {"id", "kind", "body"}: `body` is an OpenAI chat-completions request without `model` (the replayer
adds it). Kinds: `auto` (tool_choice auto or absent), `required`, `named`, `none` (tools declared, calls
forbidden), `json_schema` (response_format), `chat` (no tools). Across them: 2-6 tools per request drawn from
`tools.TOOLS`, long system prompts (~3k characters), multi-turn histories with earlier tool calls (ids in
several shapes) and their results, parallel_tool_calls false, streaming with usage, sampling seeds.

Usage: python benchmarks/k2vv/make_requests.py [--out benchmarks/k2vv/requests.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k2vv.tools import TOOLS  # noqa: E402

ASKS: dict[str, list[str]] = {
    "get_weather": ["What's the weather in Lima for the next 3 days?", "Is it going to rain in Oslo tomorrow?"],
    "book_flight": ["Book two economy seats from CDG to PEK on 2027-03-14 for Ana (34) and Li (8), window please.",
                    "I need a business flight LHR to NBO on 2027-11-02, just me, Sam Okoro, 51."],
    "create_event": ["Put a 45 minute design review on my calendar next Monday at 10:00 with ana@example.com.",
                     "Create a weekly standup at 09:30 starting tomorrow, 10 occurrences, remind me 5 min before."],
    "search_products": ["Find garden hoses under 30 dollars that are in stock, cheapest first.",
                        "Show me the 5 newest electronics books."],
    "run_sql": ["How many orders did we ship in March? Use the sales database.",
                "List employees hired after 2020 from hr, limit the query to 10 seconds."],
    "send_email": ["Email the team (dev@example.com, qa@example.com) that the release slipped to Friday.",
                   "Send a high priority note to ops@example.com: disk on db-3 is at 95%."],
    "file_op": ["Read the file src/app/config.yaml.", "Delete /tmp/cache/old.bin, it's not needed anymore."],
    "scale_deployment": ["Scale the checkout deployment in namespace prod to 12 replicas, dry run first.",
                         "Scale web in staging down to zero."],
    "translate": ["Translate 'the meeting is moved to Thursday' into French, formal.",
                  "How do you say 'where is the station' in German?"],
    "create_ticket": ["File a severity 2 bug: the login button does nothing on Safari. Steps: open page, click.",
                      "Open a security ticket, severity 1, reporter Mia from infra: tokens logged in plain text."],
    "get_quotes": ["Quotes for AAPL, MSFT and BABA in USD please.", "What is NVDA trading at in EUR?"],
    "get_time": ["What time is it right now?", "Tell me the current time before we schedule anything."],
    "update_config": ["Set the api service's proxy to 10.0.0.5:3128 and turn log level down to warning.",
                      "Enable the 'beta_search' feature flag on the gateway and set read timeout 5000 ms."],
    "convert_units": ["Convert 42 km to miles with 3 decimals.", "What is 98.6 F in Celsius?"],
}
CHAT = ["Hi! Who are you?", "Write a haiku about autumn.", "Explain what a hash map is in two sentences.",
        "Thanks, that's all for today.", "What does HTTP 429 mean?"]
POLICY = ["You are an operations assistant for a mid-sized online retailer.",
          "Always prefer calling a tool over guessing when a tool can answer the question.",
          "Never reveal internal hostnames, credentials or customer personal data in replies.",
          "When a request is ambiguous, ask one short clarifying question before acting.",
          "Dates are in the customer's local time zone unless they say otherwise.",
          "Refunds above 500 dollars need a supervisor; open a ticket instead of promising anything.",
          "Destructive operations (delete, scale to zero, config changes in prod) need an explicit confirmation.",
          "Keep answers under 120 words unless the user asks for detail.",
          "If a tool returns an error, explain it plainly and suggest the next step."]
JSON_SCHEMAS = [
    {"name": "sentiment", "schema": {"type": "object", "properties": {
        "label": {"type": "string", "enum": ["positive", "neutral", "negative"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["label", "score"]}},
    {"name": "address", "schema": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["home", "work"]}, "maxItems": 2}},
        "required": ["street", "city", "zip"]}},
]
EXAMPLE_ARGS: dict[str, dict] = {  # what the assistant sent in earlier turns (each valid for its tool)
    "get_weather": {"city": "Paris", "days": 2},
    "book_flight": {"origin": "CDG", "destination": "PEK", "date": "2027-03-14",
                    "passengers": [{"name": "Ana", "age": 34, "seat": "window"}]},
    "create_event": {"title": "Design review", "start": "2027-01-11T10:00:00", "duration_minutes": 45,
                     "attendees": [{"email": "ana@example.com"}], "reminder": None},
    "search_products": {"query": "garden hose", "filters": {"price": {"max": 30}, "in_stock": True},
                        "sort": "price_asc"},
    "run_sql": {"database": "sales", "query": "SELECT count(*) FROM orders WHERE month = ?", "params": [3]},
    "send_email": {"to": ["ops@example.com"], "subject": "Disk", "body": "db-3 at 95%", "priority": "high"},
    "file_op": {"path": "src/app/config.yaml", "operation": "read"},
    "scale_deployment": {"namespace": "prod", "deployment": "checkout", "replicas": 12, "dry_run": True},
    "translate": {"text": "the meeting is moved to Thursday", "target": "fr", "formality": "formal"},
    "create_ticket": {"title": "Login button dead on Safari", "severity": 2, "labels": ["bug", "ui"],
                      "steps": [{"order": 1, "action": "open page"}, {"order": 2, "action": "click"}]},
    "get_quotes": {"symbols": ["AAPL", "MSFT"], "currency": "USD"},
    "get_time": {},
    "update_config": {"service": "api", "settings": {"network": {"proxy": {"host": "10.0.0.5", "port": 3128}},
                                                     "log_level": "warning"}},
    "convert_units": {"value": 42, "from_unit": "km", "to_unit": "mi", "precision": 3},
}
CALL_IDS = ["call_8f2a91c0", "functions.{name}:0", "0", "toolu_01XyZ", "tc-{name}-7"]


def long_system(rng: random.Random) -> str:
    """A ~3k-character system prompt: the policy lines shuffled and numbered, repeated as sections."""
    lines = []
    for section in range(1, 5):
        order = POLICY[:]
        rng.shuffle(order)
        lines.append(f"## Section {section}")
        lines += [f"{section}.{i + 1} {text}" for i, text in enumerate(order)]
    return "\n".join(lines)


def history(rng: random.Random, name: str) -> list[dict]:
    """An earlier turn: the user asked, the assistant called `name` (an id of some shape), the tool answered."""
    call_id = rng.choice(CALL_IDS).format(name=name)
    args = EXAMPLE_ARGS[name]
    return [{"role": "user", "content": rng.choice(ASKS[name])},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": call_id,
             "content": json.dumps({"ok": True, "result": f"{name} done", "items": [1, 2, 3]})}]


def build(rng: random.Random, i: int, kind: str) -> dict:
    """Request number i of the given kind."""
    names = sorted(TOOLS)
    main = names[i % len(names)]
    others = rng.sample([n for n in names if n != main], rng.randint(1, 5))
    tools = [TOOLS[n] for n in sorted([main, *others])]
    messages: list[dict] = []
    if i % 5 == 0:
        messages.append({"role": "system", "content": long_system(rng)})
    elif i % 5 == 1:
        messages.append({"role": "system", "content": POLICY[0]})
    if i % 3 == 0 and kind != "chat":
        messages += history(rng, rng.choice(others))
    messages.append({"role": "user", "content": rng.choice(CHAT if kind == "chat" else ASKS[main])})
    body: dict = {"messages": messages, "temperature": 1.0, "seed": 1000 + i}
    if kind != "chat" and kind != "json_schema":
        body["tools"] = tools
    if kind in ("auto", "chat", "none"):
        body["max_tokens"] = 48
    else:
        body["max_tokens"] = 512
    if kind == "auto" and i % 2:
        body["tool_choice"] = "auto"
    elif kind in ("required", "none"):
        body["tool_choice"] = kind
    elif kind == "named":
        body["tool_choice"] = {"type": "function", "function": {"name": main}}
    elif kind == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": JSON_SCHEMAS[i % len(JSON_SCHEMAS)]}
    if kind in ("auto", "required") and i % 7 == 3:
        body["parallel_tool_calls"] = False
    if i % 4 == 2:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return {"id": f"{kind}-{i:03d}", "kind": kind, "body": body}


PLAN = [("auto", 36), ("required", 26), ("named", 24), ("none", 6), ("json_schema", 4), ("chat", 4)]


def make_requests(seed: int = 0) -> list[dict]:
    """The whole request set, in a fixed order (the same list for the same seed)."""
    rng = random.Random(seed)
    out, i = [], 0
    for kind, count in PLAN:
        for _ in range(count):
            out.append(build(rng, i, kind))
            i += 1
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "requests.jsonl")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rows = make_requests(args.seed)
    args.out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    print(f"wrote {len(rows)} requests to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
