"""BFCL single-turn function calling, non-live and live (simple, multiple, parallel, parallel_multiple,
irrelevance, relevance), scored by BFCL's own checker with openk2's checker alongside as a diagnostic.

Each sample is one user request plus a few function docs, offered to the model as OpenAI tools, with no system
prompt (BFCL's function-calling runner adds none). The score is BFCL's verdict (`bfcl_official`: bfcl-eval's
`ast_checker` on the calls as BFCL's OpenAI handler decodes them; irrelevance / relevance by whether the reply
decodes as a call). `detail["diagnostic"]` holds the verdict of the checker below, our own code following the
same rules, which names the failing parameter; docs/eval.md lists where the two differ and measures it.

- `simple` / `multiple`: exactly one call, to the gold function (`multiple` offers 2-4 functions).
- `parallel` / `parallel_multiple`: as many calls as gold calls, paired one-to-one in any order.
- `irrelevance`: no function fits, so the model must make no call; `relevance` (live only): it must make one.

Our checker: a call passes when its function is the gold one, every required parameter is there, no parameter
is unknown (to the doc or to the answer), every value is among the possible answers, and every parameter the
answer does not mark optional (with `""`) is given. Values compare type-aware: an int is accepted for a float
(never a bool for a number), strings ignore case, spaces and the punctuation `,./-_*^`, lists compare
element-wise and dicts key by key. An answer whose type differs from the declared one (a variable name such as
"data['sales']", or None) must be matched exactly, and an empty list counts as leaving an optional array out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from openk2.eval import bfcl_official
from openk2.eval.base import Benchmark, EvalContext, Sample, ScriptedChatModel, Verdict
from openk2.eval.bfcl_schema import bfcl_data_dir, read_jsonl, tool_name, tools_for
from openk2.llm.base import ChatModel, ChatResponse

# Our category name -> BFCL v4 file stem (only the Python flavour of `simple` is used).
CATEGORIES = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel",
              "parallel_multiple": "parallel_multiple", "irrelevance": "irrelevance",
              "live_simple": "live_simple", "live_multiple": "live_multiple", "live_parallel": "live_parallel",
              "live_parallel_multiple": "live_parallel_multiple", "live_irrelevance": "live_irrelevance",
              "live_relevance": "live_relevance"}
_NO_ANSWER = ("irrelevance", "live_irrelevance", "live_relevance")  # scored by whether a call is made
_DESCRIPTIONS = {
    "simple": "one call to the one function offered",
    "multiple": "one call, choosing among 2-4 functions",
    "parallel": "several calls to one function, any order",
    "parallel_multiple": "several calls to several functions, any order",
    "irrelevance": "no offered function fits, so no call may be made",
    "relevance": "some offered function fits, so a call must be made",
}
# BFCL's string normalisation: these characters are ignored, as are case and quote style.
_IGNORED = re.compile(r"[ ,./\-_*^]")
_PY_KINDS = {"string": (str,), "integer": (int,), "float": (int, float), "boolean": (bool,),
             "array": (list,), "tuple": (list,), "dict": (dict,)}


def _description(category: str) -> str:
    live = category.startswith("live_")
    kind = category.removeprefix("live_")
    scoring = "" if kind in ("irrelevance", "relevance") else " (BFCL AST checker)"
    return f"BFCL {'live' if live else 'non-live'} {kind}: {_DESCRIPTIONS[kind]}{scoring}"


@dataclass(frozen=True)
class Mismatch:
    """Why a model's calls fail a sample: `kind` is a stable tag (used in tests and tables), `message` prose."""

    kind: str
    message: str


class BFCLBenchmark(Benchmark):
    """One BFCL single-turn category; `name` is `bfcl-<category>` with '_' as '-'."""

    def __init__(self, category: str = "simple") -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown BFCL category {category!r}; choose from {', '.join(CATEGORIES)}")
        self.category = category
        self.bfcl_category = CATEGORIES[category]
        self.name = "bfcl-" + category.replace("_", "-")
        self.description = _description(category)

    @cached_property
    def _entries(self) -> list[Sample]:
        data = bfcl_data_dir()
        stem = f"BFCL_v4_{self.bfcl_category}.json"
        entries = read_jsonl(data / stem)
        if self.category in _NO_ANSWER:
            answers = [{"id": e["id"], "ground_truth": []} for e in entries]
        else:
            answers = read_jsonl(data / "possible_answer" / stem)
        samples = []
        for entry, answer in zip(entries, answers, strict=True):
            if entry["id"] != answer["id"]:
                raise ValueError(f"{stem}: question {entry['id']} is paired with answer {answer['id']}")
            samples.append(Sample(entry["id"], {"messages": entry["question"][0], "functions": entry["function"],
                                                "ground_truth": answer["ground_truth"]}))
        return samples

    def samples(self, limit: int | None = None) -> list[Sample]:
        return self._entries[:limit] if limit is not None else list(self._entries)

    def evaluate(self, model: ChatModel, sample: Sample, ctx: EvalContext) -> Verdict:
        tools, names = tools_for(sample.data["functions"])
        responses = model.chat(list(sample.data["messages"]), tools=tools, **ctx.sampling(sample.id))
        response = responses[0] if responses else ChatResponse(content="")
        tool_calls = list(response.tool_calls or [])
        answer = {"content": response.content,
                  "tool_calls": [c.get("function") if isinstance(c, dict) else c for c in tool_calls]}
        if self.category in _NO_ANSWER:
            official = bfcl_official.relevance_check(tool_calls, self.bfcl_category)
        else:
            official = bfcl_official.ast_check(sample.data["functions"], tool_calls, sample.data["ground_truth"],
                                               self.bfcl_category)
        mismatch = self.diagnose(sample, tool_calls, names)
        diagnostic = {"valid": mismatch is None, "error_type": mismatch.kind if mismatch else None}
        if mismatch is not None:
            diagnostic["error"] = mismatch.message
        detail: dict[str, Any] = {"diagnostic": diagnostic}
        if not official["valid"]:
            detail.update(error=_error_text(official["error"]), error_type=official["error_type"],
                          expected=sample.data["ground_truth"])
        return Verdict(1.0 if official["valid"] else 0.0, answer, detail)

    def settings(self) -> dict[str, Any]:
        scorer = "relevance" if self.category in _NO_ANSWER else "ast_checker"
        return {"scorer": f"bfcl-eval {bfcl_official.bfcl_version()} {scorer}", "system_prompt": "none",
                "mode": "function calling (OpenAI tools)", "diagnostic": "openk2 checker in detail.diagnostic"}

    def diagnose(self, sample: Sample, tool_calls: list[dict], names: dict[str, str]) -> Mismatch | None:
        """openk2's own verdict on a reply (None = pass): the diagnostic beside BFCL's score."""
        if self.category in ("irrelevance", "live_irrelevance"):
            return None if not tool_calls else Mismatch(
                "irrelevance_call", f"no function fits this request, but the model made {len(tool_calls)} call(s)")
        if self.category == "live_relevance":
            return None if tool_calls else Mismatch("no_call", "a function fits this request, but no call was made")
        calls = parse_tool_calls(tool_calls, names)
        return calls if isinstance(calls, Mismatch) else check_calls(
            sample.data["functions"], calls, sample.data["ground_truth"])

    def oracle(self, sample: Sample) -> ChatModel:
        if self.category in ("irrelevance", "live_irrelevance"):
            return ScriptedChatModel(["None of the available functions can answer this request."])
        if self.category == "live_relevance":  # the gold is "some call": the first function, no arguments
            first = sample.data["functions"][0]["name"]
            call = {"id": "call_0", "type": "function", "function": {"name": tool_name(first), "arguments": "{}"}}
            return ScriptedChatModel([ChatResponse(content=None, tool_calls=[call], finish_reason="tool_calls")])
        docs = {doc["name"]: doc for doc in sample.data["functions"]}
        calls = []
        for i, gold in enumerate(sample.data["ground_truth"]):
            (fname, params), = gold.items()
            args = gold_arguments(docs[fname], params)
            calls.append({"id": f"call_{i}", "type": "function",
                          "function": {"name": tool_name(fname), "arguments": json.dumps(args)}})
        return ScriptedChatModel([ChatResponse(content=None, tool_calls=calls, finish_reason="tool_calls")])


def _error_text(error: Any) -> str:
    """BFCL's error (a list of strings or nested dicts) as one line for the record."""
    if isinstance(error, list):
        return "; ".join(e if isinstance(e, str) else json.dumps(e, default=str) for e in error)
    return str(error)


def gold_arguments(doc: dict[str, Any], params: dict[str, list]) -> dict[str, Any]:
    """The oracle's arguments for one gold call: each parameter's first possible value. A parameter the answer
    marks optional (`""`) is left out unless the doc requires it, and so is one the doc does not declare. A
    required string whose only possible answer is `""` gets the empty string (BFCL accepts it)."""
    required = set(doc.get("parameters", {}).get("required", []))
    declared = doc.get("parameters", {}).get("properties", {})
    args = {}
    for param, alternatives in params.items():
        values = [v for v in alternatives if v != ""]
        if param in declared and values and (param in required or "" not in alternatives):
            args[param] = _literal(values[0])
        elif param in declared and param in required and alternatives == [""]:
            args[param] = ""
    return args


def _literal(pattern: Any) -> Any:
    """A concrete value for a possible-answer pattern (a dict pattern maps each key to its alternatives, which
    are plain values, as in BFCL's dict checker)."""
    if isinstance(pattern, dict):
        out = {}
        for key, alternatives in pattern.items():
            values = [v for v in alternatives if v != ""]
            if values and "" not in alternatives:
                out[key] = values[0]
        return out
    if isinstance(pattern, list):
        return [_literal(v) for v in pattern]
    return pattern


def parse_tool_calls(tool_calls: list[dict], names: dict[str, str]) -> list[tuple[str, dict]] | Mismatch:
    """OpenAI-shaped tool calls -> (BFCL function name, arguments); a Mismatch if any call is malformed.

    A name that is neither a tool name nor a BFCL name is kept as is (it fails later as a wrong function).
    """
    calls = []
    for j, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return Mismatch("bad_call", f"tool call {j} has no function name")
        raw = fn.get("arguments")
        try:
            args = raw if isinstance(raw, dict) else json.loads(raw) if raw not in (None, "") else {}
        except (TypeError, json.JSONDecodeError) as e:
            return Mismatch("bad_arguments", f"tool call {j} ({fn['name']}): arguments are not valid JSON ({e})")
        if not isinstance(args, dict):
            return Mismatch("bad_arguments", f"tool call {j} ({fn['name']}): arguments are not a JSON object")
        calls.append((names.get(fn["name"], fn["name"]), args))
    return calls


def check_calls(docs: list[dict], calls: list[tuple[str, dict]], gold: list[dict]) -> Mismatch | None:
    """None if `calls` answer the gold calls one-to-one (any order), else why not."""
    if len(calls) != len(gold):
        return Mismatch("wrong_count", f"expected {len(gold)} call(s), got {len(calls)}")
    by_name = {doc["name"]: doc for doc in docs}
    golds = [next(iter(g.items())) for g in gold]
    # fits[i][j]: None if model call j answers gold call i, else why not.
    fits = [[check_call(by_name[gname], gname, gparams, name, args) for name, args in calls]
            for gname, gparams in golds]
    if _can_pair(fits):
        return None
    for i, row in enumerate(fits):
        if all(m is not None for m in row):
            gname = golds[i][0]
            # The most telling reason comes from a call to the right function, when there is one.
            same = [m for (name, _), m in zip(calls, row, strict=True) if name == gname]
            reason = same[0] if same else row[0]
            if len(gold) == 1:
                return reason
            return Mismatch(reason.kind, f"no call matches gold call {i} ({gname}): {reason.message}")
    return Mismatch("unpaired", "every gold call has a matching call, but they cannot be paired one-to-one")


def _can_pair(fits: list[list[Mismatch | None]]) -> bool:
    """Whether every gold call gets its own compatible model call (a perfect matching, by Kuhn's augmenting
    paths; BFCL pairs greedily, which can miss a pairing that exists)."""
    owner: dict[int, int] = {}  # model call -> gold call

    def augment(i: int, seen: set[int]) -> bool:
        for j, mismatch in enumerate(fits[i]):
            if mismatch is None and j not in seen:
                seen.add(j)
                if j not in owner or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return all(augment(i, set()) for i in range(len(fits)))


def check_call(doc: dict, gold_name: str, gold_params: dict[str, list], name: str, args: dict) -> Mismatch | None:
    """None if the call `name(**args)` is one of the gold call's possible answers, else why not."""
    if name != gold_name:
        return Mismatch("wrong_function", f"called {name!r}, expected {gold_name!r}")
    schema = doc.get("parameters", {})
    declared = schema.get("properties", {})
    for param in schema.get("required", []):
        if param not in args:
            return Mismatch("missing_required", f"{name}: required parameter {param!r} is missing")
    for param, value in args.items():
        if param not in declared or param not in gold_params:
            return Mismatch("unexpected_param", f"{name}: unexpected parameter {param!r}")
        alternatives = gold_params[param]
        candidates = [alt for alt in alternatives if alt != ""]
        if _has_type(value, declared[param]):
            # An empty list stands for "not given" where the parameter is optional (BFCL reads "" as []).
            matches = (any(values_match(value, alt) for alt in candidates)
                       or (value == [] and "" in alternatives and declared[param].get("type") in ("array", "tuple")))
        elif any(type(value) is type(alt) for alt in candidates):
            # Like BFCL: an answer of another type than declared is a literal (a variable name such as
            # "data['sales']", or None), matched exactly.
            matches = value in candidates
        else:
            return Mismatch("wrong_type", f"{name}: parameter {param!r} = {value!r} is not of the declared type "
                                          f"{declared[param].get('type', 'any')!r}")
        if not matches:
            return Mismatch("wrong_value", f"{name}: parameter {param!r} = {value!r} is not among the possible "
                                           f"answers {candidates!r}")
    for param, alternatives in gold_params.items():
        if param not in args and "" not in alternatives:
            return Mismatch("missing_param", f"{name}: parameter {param!r} is missing (the answer needs it)")
    return None


def _has_type(value: Any, schema: dict) -> bool:
    """Whether `value` has the declared BFCL type (an int passes for a float, a bool never for a number)."""
    kinds = _PY_KINDS.get(schema.get("type", "any"))
    return kinds is None or (isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool)))


def standardize(text: str) -> str:
    """BFCL's string normal form: no spaces or `,./-_*^`, lower case, single quotes as double quotes."""
    return _IGNORED.sub("", text).lower().replace("'", '"')


def values_match(value: Any, pattern: Any, literal: bool = False) -> bool:
    """Whether `value` matches one possible answer. A dict pattern maps each key to its list of alternatives
    (`""` among them marks the key optional), which are plain values (`literal`: a dict among them is compared
    key by key, not read as a pattern); lists match element-wise; strings after `standardize`."""
    if isinstance(pattern, dict) and literal:
        return (isinstance(value, dict) and set(value) == set(pattern)
                and all(values_match(value[k], p, literal=True) for k, p in pattern.items()))
    if isinstance(pattern, dict):
        if not isinstance(value, dict) or not set(value) <= set(pattern):
            return False
        return (all(any(values_match(v, alt, literal=True) for alt in pattern[k] if alt != "")
                    for k, v in value.items())
                and all(k in value or "" in alts for k, alts in pattern.items()))
    if isinstance(pattern, list):
        return (isinstance(value, list) and len(value) == len(pattern)
                and all(values_match(v, p, literal) for v, p in zip(value, pattern, strict=True)))
    if isinstance(pattern, str):
        return isinstance(value, str) and standardize(value) == standardize(pattern)
    if isinstance(pattern, bool) or isinstance(value, bool):
        return isinstance(pattern, bool) and isinstance(value, bool) and value == pattern
    if isinstance(pattern, (int, float)):
        return isinstance(value, (int, float)) and value == pattern
    return value == pattern
