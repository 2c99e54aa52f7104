"""`openk2 rl-tasks`: list the RL tasks, print generated problems, and score a response (to debug a reward)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from openk2.rl import tasks


def rl_tasks_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="openk2 rl-tasks", description="Inspect the verifiable RL tasks.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="task names, difficulty levels and token budgets")
    for name, help_text in (("sample", "print generated problems"), ("check", "score a response to one problem")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("task", help="a task name, or rg:<reasoning-gym dataset>")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--difficulty", type=int, default=1)
        p.add_argument("--judge", help="ChatModel spec for LLM-judged tasks, e.g. hf:smollm2 or openai:URL#MODEL")
    sub.choices["sample"].add_argument("--count", type=int, default=1, help="problems, seeds seed..seed+count-1")
    sub.choices["sample"].add_argument("--json", action="store_true", help="one JSON object per problem")
    sub.choices["check"].add_argument("response", help="the response text, or '-' to read it from stdin")
    args = parser.parse_args(argv)

    if args.command == "list":
        for name in tasks.names():
            task = tasks.get(name)
            print(f"{name:14s} difficulties 1..{task.num_difficulties}  max_tokens {task.max_tokens}")
        print("rg:<dataset>   any reasoning-gym dataset, e.g. rg:puzzle24")
        return 0
    kwargs = {}
    if args.judge:
        from openk2.llm.registry import load_chat_model

        kwargs["judge"] = load_chat_model(args.judge)
    task = tasks.get(args.task, **kwargs)
    if args.command == "sample":
        for seed in range(args.seed, args.seed + args.count):
            problem = task.generate(seed, args.difficulty)
            if args.json:
                print(json.dumps(dataclasses.asdict(problem), default=str))
            else:
                print(f"--- {problem.task} seed {seed} difficulty {problem.difficulty}\n{problem.prompt}\n")
        return 0
    response = sys.stdin.read() if args.response == "-" else args.response
    print(task.verify(task.generate(args.seed, args.difficulty), response))
    return 0
