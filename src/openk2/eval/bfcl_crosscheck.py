"""BFCL's checker against openk2's diagnostic checker on perturbed gold answers: where and how often they differ.

`single_turn_corpus` / `multi_turn_corpus` build seeded answers from each sample's gold (the oracle's reply),
one per perturbation class; `crosscheck` scores every answer with both checkers (the benchmark's own
`evaluate`, which records both) and counts the verdict pairs per class. The classes named in `KNOWN` are the
documented differences; every other class is expected to agree. docs/eval.md holds the tables this prints:

    python -m openk2.eval.bfcl_crosscheck --per-category 40 --seed 0
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from openk2.eval.base import EvalContext, Sample, ScriptedChatModel
from openk2.eval.bfcl import BFCLBenchmark, _literal
from openk2.eval.bfcl_multi_turn import BFCLMultiTurnBenchmark
from openk2.llm.base import ChatResponse

# Known differences: the reason tag `explain` gives a disagreement -> what differs. The first four are also
# perturbation classes built to hit them.
KNOWN = {
    "empty_optional_string": "BFCL accepts '' where '' is among the possible answers; openk2 calls it a wrong value",
    "int_as_float_in_array": "BFCL checks item types inside arrays and rejects 5.0 for an integer; openk2 accepts",
    "dotted_name": "openk2 maps a dotted name back to the function; BFCL (names offered with '_') does not",
    "unparsable_call": "irrelevance: BFCL counts a call whose arguments do not parse as no call; openk2 as a call",
    "greedy_pairing": "parallel: BFCL pairs calls with gold calls greedily and can miss a pairing that openk2's "
                      "maximum matching finds",
}
SINGLE_TURN = ("simple", "multiple", "parallel", "parallel_multiple", "irrelevance", "live_simple",
               "live_multiple", "live_parallel_multiple", "live_irrelevance")
MULTI_TURN = ("base", "miss_func", "miss_param", "long_context")
_CTX = EvalContext(seed=0)

Calls = list[dict[str, Any]]  # [{"name": str, "arguments": dict | str}]


def _reply(calls: Calls | None) -> ScriptedChatModel:
    if calls is None:
        return ScriptedChatModel(["I cannot help with that."])
    tool_calls = [{"id": f"c{i}", "type": "function", "function": {
        "name": c["name"], "arguments": c["arguments"] if isinstance(c["arguments"], str) else json.dumps(
            c["arguments"])}} for i, c in enumerate(calls)]
    return ScriptedChatModel([ChatResponse(content=None, tool_calls=tool_calls, finish_reason="tool_calls")])


def _gold_calls(bench: BFCLBenchmark, sample: Sample) -> Calls:
    [reply] = bench.oracle(sample).chat([])
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
            for c in reply.tool_calls]


def _param_types(sample: Sample) -> dict[tuple[str, str], dict]:
    """(tool name as offered, parameter) -> its BFCL schema."""
    out = {}
    for doc in sample.data["functions"]:
        for param, schema in doc.get("parameters", {}).get("properties", {}).items():
            out[(doc["name"].replace(".", "_"), param)] = schema
    return out


def _changed(value: Any) -> Any:
    """A value of the same type that matches no possible answer the gold value matched."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 7
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value + "qzq"
    if isinstance(value, list):
        return value[:-1] if value else ["qzq"]
    return None


def _single_turn_answers(bench: BFCLBenchmark, sample: Sample, rng: random.Random) -> Iterator[tuple[str, Any]]:
    """(class, calls or None for a text reply) for each perturbation that applies to `sample`."""
    if bench.category in ("irrelevance", "live_irrelevance"):
        doc = sample.data["functions"][0]
        name = doc["name"].replace(".", "_")
        yield "no_call", None
        yield "call", [{"name": name, "arguments": {}}]
        yield "unparsable_call", [{"name": name, "arguments": '{"x": '}]
        return
    gold = _gold_calls(bench, sample)
    yield "gold", gold
    alternative = _alternative(sample, rng)
    if alternative is not None:
        yield "random_alternative", alternative
    yield "no_call", None
    yield "bad_json", [{"name": gold[0]["name"], "arguments": '{"a": '}, *gold[1:]]
    if len(gold) > 1:
        yield "reversed", list(reversed(gold))
        yield "one_call_missing", gold[:-1]
    yield "wrong_function", [{"name": "not_a_function", "arguments": gold[0]["arguments"]}, *gold[1:]]
    # one parameter changed, dropped or added, in a random call
    i = rng.randrange(len(gold))
    params = sorted(gold[i]["arguments"])
    types = _param_types(sample)
    if params:
        p = rng.choice(params)
        changed = _changed(gold[i]["arguments"][p])
        if changed is not None:
            yield "wrong_value", _with(gold, i, p, changed)
        yield "drop_param", _with(gold, i, p, None)
    yield "extra_param", _with(gold, i, "qzq_extra", 1)
    for (call_i, call) in enumerate(gold):
        for p, value in call["arguments"].items():
            schema = types.get((call["name"], p), {})
            if schema.get("type") == "integer" and isinstance(value, int) and not isinstance(value, bool):
                yield "float_for_integer", _with(gold, call_i, p, float(value))
            if schema.get("type") == "float" and isinstance(value, float) and value.is_integer():
                yield "integer_for_float", _with(gold, call_i, p, int(value))
            if (schema.get("type") == "array" and (schema.get("items") or {}).get("type") == "integer"
                    and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
                yield "int_as_float_in_array", _with(gold, call_i, p, [float(v) for v in value])
    # '' for a string parameter whose possible answers include ''
    for call_i, g in enumerate(sample.data["ground_truth"]):
        (fname, gparams), = g.items()
        for p, alternatives in gparams.items():
            schema = types.get((fname.replace(".", "_"), p), {})
            if "" in alternatives and schema.get("type") == "string" and len(gold) == 1:
                yield "empty_optional_string", _with(gold, call_i, p, "")
                break
        if "." in fname and len(gold) == 1:
            yield "dotted_name", [{"name": fname, "arguments": gold[call_i]["arguments"]}]


def _alternative(sample: Sample, rng: random.Random) -> Calls | None:
    """Each gold call with a random possible answer per parameter; an optional one left out half the time."""
    docs = {doc["name"]: doc for doc in sample.data["functions"]}
    calls = []
    for g in sample.data["ground_truth"]:
        (fname, gparams), = g.items()
        declared = docs[fname].get("parameters", {}).get("properties", {})
        required = set(docs[fname].get("parameters", {}).get("required", []))
        args = {}
        for p, alternatives in gparams.items():
            values = [v for v in alternatives if v != ""]
            if p not in declared or not values or ("" in alternatives and p not in required and rng.random() < 0.5):
                continue
            args[p] = _literal(rng.choice(values))
        calls.append({"name": fname.replace(".", "_"), "arguments": args})
    return calls or None


def _with(gold: Calls, i: int, param: str, value: Any) -> Calls:
    """`gold` with call i's `param` set to `value` (None: removed)."""
    calls = copy.deepcopy(gold)
    if value is None:
        calls[i]["arguments"].pop(param, None)
    else:
        calls[i]["arguments"][param] = value
    return calls


def _multi_turn_answers(bench: BFCLMultiTurnBenchmark, sample: Sample,
                        rng: random.Random) -> Iterator[tuple[str, list[ChatResponse]]]:
    turns = list(bench.oracle(sample)._turns)
    yield "gold", turns
    with_calls = [k for k, t in enumerate(turns) if t.tool_calls]
    if not with_calls:
        return
    k = rng.choice(with_calls)
    calls = turns[k].tool_calls
    j = rng.randrange(len(calls))
    yield "call_dropped", _replace(turns, k, [c for n, c in enumerate(calls) if n != j] or None)
    args = json.loads(calls[j]["function"]["arguments"])
    if args:
        p = rng.choice(sorted(args))
        changed = _changed(args[p])
        if changed is not None:
            new = copy.deepcopy(calls)
            new[j]["function"]["arguments"] = json.dumps({**args, p: changed})
            yield "argument_changed", _replace(turns, k, new)
    if len(calls) > 1:
        yield "calls_reversed", _replace(turns, k, list(reversed(calls)))
    broken = copy.deepcopy(calls)
    broken[j]["function"]["arguments"] = '{"a": '
    yield "unparsable_step", _replace(turns, k, broken)
    unknown = [*copy.deepcopy(calls), {"id": "u", "type": "function",
                                       "function": {"name": "not_a_function", "arguments": "{}"}}]
    yield "extra_unknown_call", _replace(turns, k, unknown)


def _replace(turns: list[ChatResponse], k: int, calls: list[dict] | None) -> list[ChatResponse]:
    out = list(turns)
    out[k] = (ChatResponse(content="I could not do it.", finish_reason="stop") if calls is None else
              ChatResponse(content=None, tool_calls=calls, finish_reason="tool_calls"))
    return out


def explain(bench: Any, sample: Sample, answer: Any, official: bool, detail: dict) -> str:
    """The known difference (a `KNOWN` key) that accounts for a disagreement, or "unexplained"."""
    diagnostic = detail["diagnostic"]
    calls = answer if isinstance(answer, list) and all(isinstance(c, dict) and "arguments" in c for c in answer) \
        else []
    if official and getattr(bench, "category", "").endswith("irrelevance") and \
            diagnostic["error_type"] == "irrelevance_call":
        return "unparsable_call"
    if official and diagnostic["error_type"] == "wrong_value" and any(
            isinstance(c["arguments"], dict) and "" in c["arguments"].values() for c in calls):
        return "empty_optional_string"
    if not official and diagnostic["valid"]:
        kind = detail.get("error_type") or ""
        if kind.endswith("wrong_func_name") and any("." in c["name"] for c in calls):
            return "dotted_name"
        if kind == "type_error:nested" or "type_error:nested" in str(detail.get("error")):
            return "int_as_float_in_array"
        if kind.endswith("cannot_find_match") and len(calls) <= 5 and any(
                _official_passes(bench, sample, list(order)) for order in itertools.permutations(calls)):
            return "greedy_pairing"  # the same calls in another order pass BFCL: its pairing depends on order
    return "unexplained"


def _official_passes(bench: BFCLBenchmark, sample: Sample, calls: Calls) -> bool:
    return bench.evaluate(_reply(calls), sample, _CTX).score == 1.0


def crosscheck(single_turn: tuple[str, ...] = SINGLE_TURN, multi_turn: tuple[str, ...] = MULTI_TURN,
               per_category: int = 20, seed: int = 0) -> dict[str, dict[str, Counter]]:
    """{"single_turn" | "multi_turn": {class: Counter of "both pass", "both fail", "BFCL only", "openk2 only"}}
    over `per_category` seeded samples of each category, and "reasons": {reason: Counter of the classes whose
    disagreements it explains} (see `explain`)."""
    out: dict[str, dict[str, Counter]] = {"single_turn": defaultdict(Counter), "multi_turn": defaultdict(Counter),
                                          "reasons": defaultdict(Counter)}
    jobs: list[tuple[str, Any, Callable]] = [("single_turn", BFCLBenchmark(c), _single_turn_answers)
                                             for c in single_turn]
    jobs += [("multi_turn", BFCLMultiTurnBenchmark(c), _multi_turn_answers) for c in multi_turn]
    for group, bench, answers in jobs:
        rng = random.Random(f"{seed}:{bench.name}")
        samples = bench.samples()
        for sample in rng.sample(samples, min(per_category, len(samples))):
            for cls, answer in answers(bench, sample, rng):
                model = ScriptedChatModel(answer) if group == "multi_turn" else _reply(answer)
                verdict = bench.evaluate(model, sample, _CTX)
                official, diagnostic = verdict.score == 1.0, verdict.detail["diagnostic"]["valid"]
                out[group][cls][_pair(official, diagnostic)] += 1
                if official != diagnostic:
                    out["reasons"][explain(bench, sample, answer, official, verdict.detail)][cls] += 1
    return {g: dict(v) for g, v in out.items()}


def _pair(official: bool, diagnostic: bool) -> str:
    if official == diagnostic:
        return "both pass" if official else "both fail"
    return "BFCL only" if official else "openk2 only"


def format_tables(result: dict[str, dict[str, Counter]]) -> str:
    """The agreement tables as markdown, one per group."""
    lines = []
    for group, rows in result.items():
        if group == "reasons":
            continue
        lines += [f"**{group.replace('_', '-')}**", "",
                  "| perturbation | n | both pass | both fail | BFCL only passes | openk2 only passes | agree |",
                  "|---|---|---|---|---|---|---|"]
        for cls in sorted(rows):
            c = rows[cls]
            n = sum(c.values())
            agree = c["both pass"] + c["both fail"]
            mark = " (known)" if cls in KNOWN else ""
            lines.append(f"| {cls}{mark} | {n} | {c['both pass']} | {c['both fail']} | {c['BFCL only']} | "
                         f"{c['openk2 only']} | {agree / n:.1%} |")
        lines.append("")
    lines += ["**disagreements by reason**", "", "| reason | disagreements (perturbation: n) |", "|---|---|"]
    for reason, classes in sorted(result.get("reasons", {}).items()):
        lines.append(f"| {reason} | {', '.join(f'{c}: {n}' for c, n in sorted(classes.items()))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the agreement tables."""
    parser = argparse.ArgumentParser(prog="python -m openk2.eval.bfcl_crosscheck", description=__doc__.split("\n")[0])
    parser.add_argument("--per-category", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.per_category < 1:
        raise ValueError(f"--per-category must be >= 1, got {args.per_category}")
    print(format_tables(crosscheck(per_category=args.per_category, seed=args.seed)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
