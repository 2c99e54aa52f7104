"""BFCL multi-turn (`multi_turn_base`, `_miss_func`, `_miss_param`, `_long_context`), scored by BFCL's own
`multi_turn_checker` with openk2's replay checker alongside as a diagnostic.

Each entry is a conversation of 1-7 user turns against stateful backends (a file system, a trading bot, a
travel agency, a car, ...). The backends are the Python classes `bfcl-eval` ships as the benchmark's
environment; the agent loop is written here and follows BFCL's function-calling runner: no system prompt, the
docs of every involved class as tools (less the entry's `missed_function`s in `miss_func`, which are added at
their turn together with BFCL's user message "I have updated some more functions ..."), `long_context`
backends loaded with `long_context=True`.

For each user turn the model is called in a loop: its tool calls run on the model's own backend instances and
their results come back as tool messages, until it answers without a call (at most `max_steps_per_turn` steps
with calls; one more ends the entry, as BFCL's force-quit does). The score is BFCL's verdict on the decoded
calls of every step (`bfcl_official.multi_turn_check`, which re-executes them itself). The diagnostic
(`detail["diagnostic"]`, our code) runs the turn's gold calls (strings such as `cd(folder='document')`, parsed
with `ast`) on a second set of instances, and a turn with gold calls passes when

1. the model made at least one call in it,
2. every backend's public state (its non-underscore attributes) equals the gold instances' state, and
3. the gold calls' results are contained (as a multiset, any order) in the results of all the model's calls
   so far, this turn's and earlier ones'.

A turn without gold calls (the request cannot be served) is not checked, as in BFCL; the diagnostic names the
first failing turn.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import inspect
import json
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from openk2.eval import bfcl_official
from openk2.eval.base import Benchmark, EvalContext, Sample, ScriptedChatModel, Verdict
from openk2.eval.bfcl_schema import bfcl_data_dir, read_jsonl, tools_for
from openk2.llm.base import ChatModel, ChatResponse

# Backend class -> (module under bfcl_eval's func_source_code, function-doc file); the `multi_turn_base` set.
BACKENDS = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}
_BACKEND_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
CATEGORIES = ("base", "miss_func", "miss_param", "long_context")
# BFCL's user turn when held-out functions are added (DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC).
ADDED_FUNCTIONS_PROMPT = "I have updated some more functions you can choose from. What about now?"
_VALID_NAME = re.compile(r"[\w.\-]+")
_SHOWN = 300  # characters of a state value or tool result kept in a verdict's detail


class Environment:
    """One instance of each involved backend class, loaded with the entry's initial configuration.

    Any public method can be called, documented or not, as in BFCL (`functions` maps each name to its bound
    method); results are turned into text the way BFCL does (a dict as JSON, anything else with `str`, an
    exception as `Error during execution: ...`).
    """

    def __init__(self, class_names: list[str], initial_config: dict[str, Any], long_context: bool = False) -> None:
        self.instances: dict[str, Any] = {}
        self.functions: dict[str, Callable[..., Any]] = {}
        for class_name in class_names:
            if class_name not in BACKENDS:
                raise ValueError(f"unknown BFCL backend class {class_name!r}; known: {', '.join(BACKENDS)}")
            module = importlib.import_module(f"{_BACKEND_PACKAGE}.{BACKENDS[class_name][0]}")
            instance = getattr(module, class_name)()
            if hasattr(instance, "_load_scenario"):  # stateless classes (MathAPI) have no scenario
                # A deep copy, so no run can change the sample's configuration (backends mutate what they load).
                instance._load_scenario(copy.deepcopy(initial_config.get(class_name, {})),
                                        long_context=long_context)
            self.instances[class_name] = instance
            for name, method in inspect.getmembers(instance, inspect.ismethod):
                if not name.startswith("_"):
                    self.functions[name] = method

    def execute(self, name: str, arguments: dict[str, Any]) -> str:
        """Run one call and return its result as text (errors included, never raised)."""
        if name not in self.functions:
            return f"Error during execution: no function named {name!r}"
        try:
            # A copy: backends keep (and later mutate) what they are given, which must not rewrite the record.
            result = self.functions[name](**copy.deepcopy(arguments))
        except Exception as e:  # a bad call is part of the model's trajectory, not a crash of ours
            return f"Error during execution: {e}"
        if isinstance(result, str):
            return result
        if isinstance(result, dict):
            try:
                return json.dumps(result)
            except (TypeError, ValueError):
                return str(result)
        return str(result)

    def keyword_arguments(self, name: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A gold call's positional and keyword arguments as keywords only (tool calls carry only keywords)."""
        if name not in self.functions:
            raise ValueError(f"gold call to unknown function {name!r}")
        return dict(inspect.signature(self.functions[name]).bind(*args, **kwargs).arguments)

    def state_differences(self, other: Environment) -> dict[str, dict[str, Any]]:
        """Public attributes whose values differ from `other`'s, per class (as short reprs); empty when equal."""
        out: dict[str, dict[str, Any]] = {}
        for class_name, theirs in other.instances.items():
            mine = self.instances[class_name]
            for attr, expected in vars(theirs).items():
                if attr.startswith("_"):
                    continue
                got = getattr(mine, attr, None)
                if got != expected:
                    out.setdefault(class_name, {})[attr] = {"model": _short(got), "expected": _short(expected)}
        return out


def parse_gold_call(text: str) -> tuple[str, tuple, dict[str, Any]]:
    """`"mv(source='a', destination='b')"` -> ("mv", (), {"source": "a", "destination": "b"})."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"gold call {text!r} is not a plain function call")
    args = tuple(ast.literal_eval(a) for a in node.args)
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    return node.func.id, args, kwargs


def function_docs(class_names: list[str]) -> list[dict]:
    """The BFCL function docs of the given backend classes (all of them, as BFCL offers them)."""
    return [doc for name in class_names for doc in _class_docs(name)]


@functools.cache
def _class_docs(class_name: str) -> tuple[dict, ...]:
    if class_name not in BACKENDS:
        raise ValueError(f"unknown BFCL backend class {class_name!r}; known: {', '.join(BACKENDS)}")
    return tuple(read_jsonl(bfcl_data_dir() / "multi_turn_func_doc" / BACKENDS[class_name][1]))


class BFCLMultiTurnBenchmark(Benchmark):
    """One BFCL v4 multi-turn category (200 conversations each), scored by BFCL's checker."""

    def __init__(self, category: str = "base", max_steps_per_turn: int = 20) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown BFCL multi-turn category {category!r}; choose from {', '.join(CATEGORIES)}")
        if max_steps_per_turn < 1:
            raise ValueError(f"max_steps_per_turn must be >= 1, got {max_steps_per_turn}")
        self.category = category
        self.bfcl_category = f"multi_turn_{category}"
        self.name = "bfcl-multi-turn" + ("" if category == "base" else "-" + category.replace("_", "-"))
        self.description = (f"BFCL multi-turn {category.replace('_', ' ')}: agent loop on stateful backends "
                            "(BFCL multi_turn_checker)")
        self.max_steps_per_turn = max_steps_per_turn  # BFCL's MAXIMUM_STEP_LIMIT is 20 as well

    @functools.cached_property
    def _entries(self) -> list[Sample]:
        data = bfcl_data_dir()
        stem = f"BFCL_v4_{self.bfcl_category}.json"
        samples = []
        for entry, answer in zip(read_jsonl(data / stem), read_jsonl(data / "possible_answer" / stem), strict=True):
            if entry["id"] != answer["id"] or len(entry["question"]) != len(answer["ground_truth"]):
                raise ValueError(f"{stem}: question {entry['id']} does not line up with answer {answer['id']}")
            samples.append(Sample(entry["id"], {
                "turns": entry["question"], "ground_truth": answer["ground_truth"],
                "initial_config": entry["initial_config"], "involved_classes": entry["involved_classes"],
                "missed_function": entry.get("missed_function") or {}}))
        return samples

    def samples(self, limit: int | None = None) -> list[Sample]:
        return self._entries[:limit] if limit is not None else list(self._entries)

    def settings(self) -> dict[str, Any]:
        return {"scorer": f"bfcl-eval {bfcl_official.bfcl_version()} multi_turn_checker", "system_prompt": "none",
                "mode": "function calling (OpenAI tools)", "max_steps_per_turn": self.max_steps_per_turn,
                "diagnostic": "openk2 replay checker in detail.diagnostic"}

    def _environment(self, sample: Sample) -> Environment:
        return Environment(sample.data["involved_classes"], sample.data["initial_config"],
                           long_context=self.category == "long_context")

    def evaluate(self, model: ChatModel, sample: Sample, ctx: EvalContext) -> Verdict:
        missed = {int(t): set(names) for t, names in sample.data["missed_function"].items()}
        held_out = set().union(*missed.values()) if missed else set()
        all_docs = function_docs(sample.data["involved_classes"])
        docs = [d for d in all_docs if d["name"] not in held_out]
        env, gold_env = self._environment(sample), self._environment(sample)
        messages: list[dict] = []
        trajectory: list[list[dict]] = []
        turn_calls: list[list[list[dict]]] = []  # per turn, per step: the tool calls (for BFCL's checker)
        all_results: list[str] = []  # every result of the model's calls so far (BFCL's response check is cumulative)
        diagnostic: dict[str, Any] | None = None
        forced = False
        for t, (turn, gold_calls) in enumerate(zip(sample.data["turns"], sample.data["ground_truth"], strict=True)):
            if t in missed:  # BFCL adds the held-out docs (at the end) and says so in a user turn
                docs = docs + [d for d in all_docs if d["name"] in missed[t]]
                turn = [{"role": "user", "content": ADDED_FUNCTIONS_PROMPT}]
            tools, names = tools_for(docs)
            messages.extend(turn)
            steps, calls, failure = self._run_turn(model, messages, tools, names, env, ctx, f"{sample.id}:{t}")
            trajectory.append(steps)
            turn_calls.append(calls)
            all_results.extend(r for step in steps for r in step.get("results", []))
            gold_results = []
            for text in gold_calls:
                name, args, kwargs = parse_gold_call(text)
                gold_results.append(gold_env.execute(name, gold_env.keyword_arguments(name, args, kwargs)))
            if failure is None and gold_calls:
                failure = _check_turn(t, steps, env, gold_env, all_results, gold_results)
            if failure is not None and diagnostic is None:
                diagnostic = {"valid": False, "turn": t, **failure}
            if failure is not None and failure["error_type"] == "step_limit":
                forced = True  # BFCL's force-quit: the entry ends here
                break
        official = bfcl_official.multi_turn_check(turn_calls, {"id": sample.id, **sample.data},
                                                  sample.data["ground_truth"], force_terminated=forced)
        detail: dict[str, Any] = {"diagnostic": diagnostic or {"valid": True, "error_type": None}}
        if not official["valid"]:
            detail.update(error=str(official["error"]), error_type=official["error_type"])
        return Verdict(1.0 if official["valid"] else 0.0, trajectory, detail)

    def _run_turn(self, model: ChatModel, messages: list[dict], tools: list[dict], names: dict[str, str],
                  env: Environment, ctx: EvalContext,
                  key: str) -> tuple[list[dict], list[list[dict]], dict | None]:
        """Loop the model on one user turn, appending to `messages`: the steps, each step's raw tool calls and
        a failure, if any."""
        steps: list[dict] = []
        raw: list[list[dict]] = []
        for step in range(self.max_steps_per_turn + 1):
            sampling = ctx.sampling(key, seed=ctx.sample_seed(f"{key}:{step}"))
            responses = model.chat(messages, tools=tools, **sampling)
            response = responses[0] if responses else ChatResponse(content="")
            raw.append(copy.deepcopy(list(response.tool_calls or [])))
            calls = _decode(response.tool_calls, names)
            if not calls:  # plain text (or undecodable calls, which BFCL also treats as the end of the turn)
                messages.append({"role": "assistant", "content": response.content or ""})
                steps.append({"content": response.content, "undecodable": calls is None})
                return steps, raw, None
            if step == self.max_steps_per_turn:
                return steps, raw, {"error": f"still calling tools after {self.max_steps_per_turn} steps",
                                    "error_type": "step_limit"}
            ids = [f"call_{key}_{step}_{j}".replace(":", "_") for j in range(len(calls))]
            messages.append({"role": "assistant", "content": response.content, "tool_calls": [
                {"id": i, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}
                for i, (tool, _, args) in zip(ids, calls, strict=True)]})
            results = [env.execute(name, args) for _, name, args in calls]
            messages.extend({"role": "tool", "tool_call_id": i, "content": r}
                            for i, r in zip(ids, results, strict=True))
            steps.append({"content": response.content, "calls": [{"name": n, "arguments": a} for _, n, a in calls],
                          "results": results})
        raise AssertionError("unreachable: the loop returns by its last step")

    def oracle(self, sample: Sample) -> ChatModel:
        env = self._environment(sample)  # only for the functions' signatures
        turns: list[ChatResponse] = []
        for t, gold_calls in enumerate(sample.data["ground_truth"]):
            if gold_calls:
                calls = []
                for j, text in enumerate(gold_calls):
                    name, args, kwargs = parse_gold_call(text)
                    calls.append({"id": f"gold_{t}_{j}", "type": "function", "function": {
                        "name": name, "arguments": json.dumps(env.keyword_arguments(name, args, kwargs))}})
                turns.append(ChatResponse(content=None, tool_calls=calls, finish_reason="tool_calls"))
                turns.append(ChatResponse(content="Done.", finish_reason="stop"))
            else:
                turns.append(ChatResponse(content="I cannot do that with the tools I have.", finish_reason="stop"))
        return ScriptedChatModel(turns)


def _decode(tool_calls: list[dict], names: dict[str, str]) -> list[tuple[str, str, dict]] | None:
    """Tool calls -> (tool name, BFCL name, arguments); None if any call is malformed (a name that is not a
    plain identifier, arguments that are not a JSON object). Unknown names decode; they fail when executed."""
    calls = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not _VALID_NAME.fullmatch(name):
            return None
        raw = fn.get("arguments")
        try:
            args = raw if isinstance(raw, dict) else json.loads(raw) if raw not in (None, "") else {}
        except (TypeError, json.JSONDecodeError):
            return None
        if not isinstance(args, dict):
            return None
        calls.append((name, names.get(name, name), args))
    return calls


def _check_turn(t: int, steps: list[dict], env: Environment, gold_env: Environment, all_results: list[str],
                gold_results: list[str]) -> dict | None:
    """Why turn `t` fails BFCL's checks, or None if it passes."""
    if not any(step.get("calls") for step in steps):
        return {"error": f"turn {t} needs tool calls, but the model made none", "error_type": "no_calls"}
    differences = env.state_differences(gold_env)
    if differences:
        return {"error": f"after turn {t} the backend state differs from the gold state ({', '.join(differences)})",
                "error_type": "state_mismatch", "differences": differences}
    missing = Counter(gold_results) - Counter(all_results)
    if missing:
        return {"error": f"after turn {t}, {sum(missing.values())} gold call result(s) never came out of the "
                         "model's calls", "error_type": "result_mismatch",
                "missing_results": [_short(r) for r in missing.elements()]}
    return None


def _short(value: Any) -> str:
    """A value's repr, cut to a readable length for verdict details."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
