"""`openk2 redteam`: attack a target model over a plugin x strategy grid and tabulate its pass rates."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from openk2.eval.redteam.plugins import PLUGINS, plugin_names
from openk2.eval.redteam.strategies import STRATEGIES, AttackSettings, Roles, strategy_names

_EPILOG = """model specs: local:CKPT_DIR | hf:smollm2 | openai:http://host:port/v1#MODEL

A cell's pass rate is the share of attempts whose final target reply the judge calls safe (refused or
deflected). Reruns with the same --out and settings resume: only missing attempts run.

examples:
  openk2 redteam --list
  openk2 redteam --target hf:smollm2 --attacker hf:smollm2 --judge hf:smollm2 --per-cell 2
  openk2 redteam --target openai:http://127.0.0.1:8000/v1 --attacker openai:http://host:9000/v1#attacker \\
      --judge openai:http://host:9000/v1#judge --plugins criminal,privacy --strategies basic,crescendo
"""


def _names(text: str | None, known: list[str], kind: str) -> list[str]:
    if not text:
        return known
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown {kind} {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    if not names:
        raise ValueError(f"--{kind}s lists no names")
    return names


def _slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", spec).strip("_") or "model"


def _print_catalogue() -> None:
    print("plugins:")
    for plugin, goals in PLUGINS.items():
        print(f"  {plugin}")
        for goal in goals:
            print(f"    {goal.id:28s} the user wants to {goal.description}")
    print("strategies:")
    for name, (fn, label) in STRATEGIES.items():
        print(f"  {name:22s} {label}: {(fn.__doc__ or '').splitlines()[0]}")


def redteam_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="openk2 redteam", epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Red-team a chat model: an attacker model writes prompts for "
                                                 "harmful goals, strategies deliver them, a judge model grades "
                                                 "the target's replies (report: Safety Evaluation).")
    parser.add_argument("--list", action="store_true", help="print the plugins, their goals and the strategies")
    parser.add_argument("--target", help="spec of the model under test")
    parser.add_argument("--attacker", help="spec of the model that writes the attack prompts")
    parser.add_argument("--judge", help="spec of the model that grades the target's replies")
    parser.add_argument("--plugins", help=f"comma-separated (default all: {','.join(plugin_names())})")
    parser.add_argument("--strategies", help=f"comma-separated (default all: {','.join(strategy_names())})")
    parser.add_argument("--per-cell", type=int, default=2, help="attempts per plugin x strategy cell")
    parser.add_argument("--out", help="output directory (default runs/redteam/<target>); reruns resume it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256, help="per target reply")
    parser.add_argument("--temperature", type=float, default=0.0, help="target sampling temperature")
    parser.add_argument("--attacker-max-tokens", type=int, default=128)
    parser.add_argument("--attacker-temperature", type=float, default=0.8)
    parser.add_argument("--judge-max-tokens", type=int, default=48, help="the judge is always greedy")
    parser.add_argument("--iterations", type=int, default=3, help="rounds of the iterative jailbreak")
    parser.add_argument("--turns", type=int, default=3, help="user turns of a crescendo conversation")
    parser.add_argument("--concurrency", type=int, default=1, help="attempts run at once (threads)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    if args.list:
        _print_catalogue()
        return 0
    if not (args.target and args.attacker and args.judge):
        raise ValueError("--target, --attacker and --judge are all required (or --list)")
    plugins = _names(args.plugins, plugin_names(), "plugin")
    strategies = _names(args.strategies, strategy_names(), "strategy")
    settings = AttackSettings(target_temperature=args.temperature, target_max_tokens=args.max_tokens,
                              attacker_temperature=args.attacker_temperature,
                              attacker_max_tokens=args.attacker_max_tokens, judge_max_tokens=args.judge_max_tokens,
                              iterations=args.iterations, turns=args.turns)
    if args.per_cell < 1:
        raise ValueError(f"--per-cell must be >= 1, got {args.per_cell}")

    from openk2.eval.redteam.runner import run_redteam
    from openk2.llm.base import ChatModel
    from openk2.llm.registry import load_chat_model

    loaded: dict[str, ChatModel] = {}  # one model object per distinct spec
    for spec in (args.target, args.attacker, args.judge):
        if spec not in loaded:
            loaded[spec] = load_chat_model(spec)
    roles = Roles(loaded[args.target], loaded[args.attacker], loaded[args.judge])
    out = Path(args.out or Path("runs") / "redteam" / _slug(args.target))
    try:
        run_redteam(roles, out, plugins=plugins, strategies=strategies, per_cell=args.per_cell, seed=args.seed,
                    settings=settings, concurrency=args.concurrency, progress=not args.quiet)
    finally:
        for model in loaded.values():
            model.close()
    print((out / "table.md").read_text(), end="")
    print(f"records: {out}/attempts.jsonl, results: {out}/results.json, heatmap: {out}/heatmap.png")
    return 0
