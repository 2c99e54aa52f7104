"""Programmatic tool-use conversations for fine-tuning tiny models (a tiny LLM cannot synthesise usable ones).

`generate(n, seed)` returns seeded conversations in the SFT JSONL shape ({"messages": [...], "tools": [...]}):
a user asks something one of four simple tools answers (weather, calculator, unit conversion, time), the
assistant calls it with correct JSON arguments, the tool result comes back and the assistant answers from it;
a share of the conversations are plain chat turns that need no tool (some still declare tools, so the model
learns that declared tools are optional). Tool results are computed (arithmetic, conversions) or drawn from
the seed (weather, clock time), so every answer agrees with its tool result.

`heldout_prompts(n, seed)` returns prompts that end at the user turn, with the call the assistant should make.
Their cities, time zones and numbers come from pools disjoint from the training ones (and their own RNG
stream), so a model can only score on them by generalising the format, not by recalling a training example.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from openk2.chat.tool_parsers.kimi_k2 import format_call_id

TOOLS: dict[str, dict] = {
    "get_weather": {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    "calculate": {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    "convert_units": {
        "type": "function",
        "function": {
            "name": "convert_units",
            "description": "Convert a value between units.",
            "parameters": {
                "type": "object",
                "properties": {
                    "value": {"type": "number"},
                    "from_unit": {"type": "string"},
                    "to_unit": {"type": "string"},
                },
                "required": ["value", "from_unit", "to_unit"],
            },
        },
    },
    "get_time": {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current local time in an IANA time zone.",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string"}},
                "required": ["timezone"],
            },
        },
    },
}

# Entity pools: training draws from the first, held-out prompts from the second; they share no entries.
CITIES = (
    ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Lima", "Oslo", "Dublin", "Vienna",
     "Prague", "Athens", "Lisbon", "Seoul", "Boston", "Denver", "Chicago", "Toronto", "Sydney", "Mumbai",
     "Nairobi", "Warsaw", "Zurich"],
    ["Helsinki", "Bogota", "Hanoi", "Quito", "Manila", "Dakar", "Riga", "Perth", "Austin", "Porto"],
)
TIMEZONES = (
    ["Europe/Paris", "Europe/London", "Asia/Tokyo", "Europe/Berlin", "America/New_York", "America/Chicago",
     "Australia/Sydney", "Asia/Kolkata", "Africa/Cairo", "America/Lima", "Europe/Madrid", "Asia/Seoul"],
    ["Asia/Singapore", "America/Denver", "Europe/Helsinki", "Africa/Lagos", "Pacific/Auckland"],
)
NUMBERS = (range(2, 60), range(60, 100), range(100, 1000))  # calculator operands and conversion values
NOVEL = 2  # the third "pool": made-up cities and zones, 3-digit numbers (training only, see `generate`)
SYLLABLES = ["ka", "lo", "mi", "ren", "do", "sa", "vel", "tor", "ni", "bra", "quo", "zan", "pe", "lu", "gor"]
REGIONS = ["Europe", "Asia", "America", "Africa", "Australia"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy"]
# (from, to, factor or None for temperature, phrase for the unit names)
CONVERSIONS = [
    ("km", "miles", 0.621371), ("miles", "km", 1.609344), ("kg", "lb", 2.204623), ("lb", "kg", 0.453592),
    ("m", "ft", 3.28084), ("ft", "m", 0.3048), ("celsius", "fahrenheit", None), ("fahrenheit", "celsius", None),
]
OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

SYSTEM_PROMPTS = ["You are a helpful assistant with tools.", "Answer briefly. Use tools when they help."]
PREAMBLES = ["", "", "Let me check.", "One moment."]
THANKS = ["Thanks!", "Thank you.", "Great, thanks."]
WELCOME = ["You're welcome!", "Glad to help.", "Any time!"]


@dataclass(frozen=True)
class ToolTask:
    """One request that a tool answers: the user's words, the expected call and how to answer its result."""

    prompt: str
    tool: str
    arguments: dict
    result: dict
    answer: str


def _novel_name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in taken:
            return name


def _city(rng: random.Random, pool: int) -> str:
    return _novel_name(rng, set(CITIES[0]) | set(CITIES[1])) if pool == NOVEL else rng.choice(CITIES[pool])


def _zone(rng: random.Random, pool: int) -> str:
    if pool != NOVEL:
        return rng.choice(TIMEZONES[pool])
    taken = {zone.split("/")[-1] for zone in TIMEZONES[0] + TIMEZONES[1]}
    return f"{rng.choice(REGIONS)}/{_novel_name(rng, taken)}"


def _weather(rng: random.Random, pool: int) -> ToolTask:
    city = _city(rng, pool)
    unit = rng.choice([None, None, "celsius", "fahrenheit"])
    templates = ["What's the weather in {c}?", "How is the weather in {c} today?", "Is it raining in {c}?",
                 "Weather for {c}, please.", "Tell me the weather in {c}."]
    prompt = rng.choice(templates).format(c=city)
    args: dict = {"city": city}
    if unit is not None:
        prompt = prompt.rstrip("?.") + f" in {unit}?"
        args["unit"] = unit
    temp_c = rng.randint(-5, 35)
    temp = round(temp_c * 9 / 5 + 32) if unit == "fahrenheit" else temp_c
    symbol = "F" if unit == "fahrenheit" else "C"
    condition = rng.choice(CONDITIONS)
    result = {"city": city, "temperature": temp, "unit": unit or "celsius", "condition": condition}
    return ToolTask(prompt, "get_weather", args, result, f"It is {temp} degrees {symbol} and {condition} in {city}.")


def _calculate(rng: random.Random, pool: int) -> ToolTask:
    a, b = rng.choice(NUMBERS[pool]), rng.choice(NUMBERS[pool])
    op = rng.choice(list(OPERATORS))
    expression = f"{a} {op} {b}"
    value = OPERATORS[op](a, b)
    templates = ["What is {e}?", "Calculate {e}.", "Can you compute {e}?", "How much is {e}?", "{e} = ?"]
    return ToolTask(rng.choice(templates).format(e=expression), "calculate", {"expression": expression},
                    {"result": value}, f"{expression} = {value}.")


def _convert(rng: random.Random, pool: int) -> ToolTask:
    src, dst, factor = rng.choice(CONVERSIONS)
    value = rng.choice(NUMBERS[pool])
    if factor is not None:
        converted = round(value * factor, 2)
    elif src == "celsius":
        converted = round(value * 9 / 5 + 32, 2)
    else:
        converted = round((value - 32) * 5 / 9, 2)
    templates = ["Convert {v} {s} to {d}.", "How many {d} is {v} {s}?", "What is {v} {s} in {d}?",
                 "{v} {s} in {d}, please."]
    prompt = rng.choice(templates).format(v=value, s=src, d=dst)
    args = {"value": value, "from_unit": src, "to_unit": dst}
    return ToolTask(prompt, "convert_units", args, {"result": converted, "unit": dst},
                    f"{value} {src} is {converted} {dst}.")


def _time(rng: random.Random, pool: int) -> ToolTask:
    zone = _zone(rng, pool)
    clock = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    templates = ["What time is it in {z}?", "Current time in {z}?", "Tell me the time in the {z} time zone.",
                 "What's the local time for {z}?"]
    return ToolTask(rng.choice(templates).format(z=zone), "get_time", {"timezone": zone},
                    {"timezone": zone, "time": clock}, f"It is {clock} in {zone}.")


TASKS: dict[str, Callable[[random.Random, int], ToolTask]] = {
    "get_weather": _weather, "calculate": _calculate, "convert_units": _convert, "get_time": _time,
}

# Plain turns: (user, assistant) builders that need no tool.
PLAIN_CHAT: list[Callable[[random.Random], tuple[str, str]]] = [
    lambda r: (r.choice(["Hi!", "Hello.", "Hey there.", "Good morning!"]), "Hello! How can I help you today?"),
    lambda r: ("What can you do?", "I can check the weather, do arithmetic, convert units and tell the time."),
    lambda r: (lambda w: (f"Repeat after me: {w}", w))(r.choice(["blue sky", "good night", "open door",
                                                                 "green tea", "fast car", "quiet river"])),
    lambda r: (lambda w: (f"Say {w} in capital letters.", w.upper()))(r.choice(["hello", "tools", "python",
                                                                                "kimi", "music", "water"])),
    lambda r: ("Who are you?", "I am Kimi, an AI assistant."),
]


def _declared_tools(rng: random.Random, needed: str | None) -> list[dict]:
    """The needed tool and at most one other, in random order (one or two others when no tool is needed).
    Declarations are most of a conversation's tokens, so they are kept few for tiny models' short rows."""
    others = [name for name in TOOLS if name != needed]
    names = rng.sample(others, rng.randint(0, 1) if needed else rng.randint(1, 2)) + ([needed] if needed else [])
    rng.shuffle(names)
    return [TOOLS[name] for name in names]


def _tool_conversation(rng: random.Random, pool: int) -> dict:
    task = TASKS[rng.choice(list(TASKS))](rng, pool)
    messages: list[dict] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    # K2's own id form: the chat template renders ids verbatim, and `functions.NAME:IDX` is what K2 was trained
    # on (the only place the called function's name reaches the model in tool results).
    call_id = format_call_id(task.tool, 0)
    messages += [
        {"role": "user", "content": task.prompt},
        {"role": "assistant", "content": rng.choice(PREAMBLES), "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": task.tool, "arguments": json.dumps(task.arguments)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps(task.result)},
        {"role": "assistant", "content": task.answer},
    ]
    if rng.random() < 0.25:
        messages += [{"role": "user", "content": rng.choice(THANKS)},
                     {"role": "assistant", "content": rng.choice(WELCOME)}]
    return {"messages": messages, "tools": _declared_tools(rng, task.tool)}


def _plain_conversation(rng: random.Random) -> dict:
    user, answer = rng.choice(PLAIN_CHAT)(rng)
    conversation: dict = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
    if rng.random() < 0.5:
        conversation["tools"] = _declared_tools(rng, None)
    return conversation


def generate(n: int, seed: int = 0, plain_fraction: float = 0.2, novel_fraction: float = 0.0) -> list[dict]:
    """`n` training conversations ({"messages", "tools"?}); the same arguments always give the same list.

    A share `novel_fraction` of the tool conversations use made-up entities (city and zone names from
    syllables, 3-digit numbers) that no other conversation repeats, so their arguments can only be copied from
    the request, never recalled; none equals a held-out entity."""
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if not 0 <= plain_fraction <= 1:
        raise ValueError(f"plain_fraction must lie in [0, 1], got {plain_fraction}")
    if not 0 <= novel_fraction <= 1:
        raise ValueError(f"novel_fraction must lie in [0, 1], got {novel_fraction}")
    rng = random.Random(f"toolchat-train-{seed}")
    conversations = []
    for _ in range(n):
        if rng.random() < plain_fraction:
            conversations.append(_plain_conversation(rng))
        else:
            pool = NOVEL if novel_fraction and rng.random() < novel_fraction else 0
            conversations.append(_tool_conversation(rng, pool))
    return conversations


def heldout_prompts(n: int, seed: int = 0) -> list[dict]:
    """`n` evaluation prompts {"messages" (ending at the user turn), "tools", "expected": {name, arguments}},
    built from entity pools that training never uses."""
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    rng = random.Random(f"toolchat-heldout-{seed}")
    names = list(TASKS)
    prompts = []
    for i in range(n):
        task = TASKS[names[i % len(names)]](rng, 1)  # round-robin: every tool equally represented
        messages = [{"role": "user", "content": task.prompt}]
        prompts.append({"messages": messages, "tools": _declared_tools(rng, task.tool),
                        "expected": {"name": task.tool, "arguments": task.arguments}})
    return prompts
