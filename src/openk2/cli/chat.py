"""`openk2 chat`: a terminal chat with any `ChatModel` spec (`local:PATH`, `hf:smollm2`, `openai:URL#MODEL`).

The conversation is kept and sent whole on every turn. `--mcp "python -m mcp_server_time"` (repeatable) starts
an MCP server over stdio and offers its tools; the model's calls to them are executed for real and shown as
they happen (call, then result). With `--tools FILE.json` (a JSON list of OpenAI function tool specs) the model
may call tools that have no executor: each call is printed and the user types the result (an empty line sends
`{"error": "no executor"}`), or with `--no-interactive-tools` that stub is sent at once. The model then
continues, up to `--max-tool-rounds` times per user turn. Commands: `/reset` clears the history (keeping
`--system`), `/exit` (or `/quit`, or EOF) leaves.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from openk2.llm.registry import load_chat_model

NO_EXECUTOR = json.dumps({"error": "no executor"})


def _load_tools(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        tools = json.load(f)
    if isinstance(tools, dict) and "tools" in tools:
        tools = tools["tools"]
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise ValueError(f"{path}: expected a JSON list of OpenAI function tools "
                         '([{"type": "function", "function": {"name": ..., "parameters": {...}}}, ...])')
    return tools


def _start_mcp(commands: list[str]) -> tuple[list[Any], list[dict], dict[str, Any]]:
    """(servers, their tools as OpenAI specs, tool name -> server); all started servers are closed on failure."""
    from openk2.agentic.mcp_client import MCPServer

    servers: list[Any] = []
    specs: list[dict] = []
    routes: dict[str, Any] = {}
    try:
        for command in commands:
            server = MCPServer(command)
            servers.append(server)
            for spec in server.list_tools():
                name = spec["function"]["name"]
                if name in routes:
                    raise ValueError(f"tool {name!r} is offered by both {routes[name].name} and {server.name}")
                routes[name] = server
                specs.append({"type": "function", "function": spec["function"]})
    except BaseException:
        for server in servers:
            server.close()
        raise
    return servers, specs, routes


def _call_mcp(server: Any, name: str, arguments: str) -> str:
    """Run one tool call on its MCP server; every failure becomes a JSON error result for the model."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as e:
        return json.dumps({"error": f"arguments are not valid JSON: {e}"})
    if not isinstance(args, dict):
        return json.dumps({"error": "arguments must be a JSON object"})
    try:
        result = server.call_tool(name, args)
    except Exception as e:  # noqa: BLE001 - a failing tool is the model's problem to handle, not the session's
        return json.dumps({"error": f"{type(e).__name__}: {e}"})
    content = result.as_message_content()
    return json.dumps({"error": content}) if result.is_error else content


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="openk2 chat", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="chat model spec: local:PATH, hf:smollm2, hf:DIR|FILE.gguf, "
                                                  "openai:URL#MODEL")
    p.add_argument("--tools", help="JSON file: a list of OpenAI function tool specs")
    p.add_argument("--mcp", action="append", default=[], metavar="CMD",
                   help='MCP server command whose tools are offered and executed for real, e.g. '
                        '"python -m mcp_server_time" (repeatable)')
    p.add_argument("--system", help="system message")
    p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy); backend default if unset")
    p.add_argument("--max-tokens", type=int, help="completion token limit per reply")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--no-interactive-tools", action="store_true",
                   help=f"answer every tool call with {NO_EXECUTOR} instead of asking")
    p.add_argument("--max-tool-rounds", type=int, default=8, help="model calls per user turn (default 8)")
    return p


def _read(prompt: str, stdin: TextIO, stdout: TextIO) -> str | None:
    stdout.write(prompt)
    stdout.flush()
    line = stdin.readline()
    if not line:
        stdout.write("\n")
        return None
    return line.rstrip("\r\n")


def chat_main(argv: list[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Run the chat loop; 0 on /exit or EOF, 1 if the model cannot be loaded, 2 on bad arguments."""
    args = _parser().parse_args(argv)
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    tools: list[dict] | None = None
    if args.tools:
        try:
            tools = _load_tools(args.tools)
        except (OSError, ValueError) as e:
            print(f"openk2 chat: {e}", file=sys.stderr)
            return 2
    try:
        model = load_chat_model(args.model)
    except Exception as e:  # noqa: BLE001 - any backend failure is reported, not raised
        print(f"openk2 chat: cannot load {args.model!r}: {e}", file=sys.stderr)
        return 1
    try:
        servers, mcp_specs, mcp_routes = _start_mcp(args.mcp)
    except ValueError as e:
        print(f"openk2 chat: {e}", file=sys.stderr)
        model.close()
        return 2
    if mcp_specs:
        tools = (tools or []) + mcp_specs
    sampling: dict[str, Any] = {}
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    if args.max_tokens is not None:
        sampling["max_tokens"] = args.max_tokens
    if args.seed is not None:
        sampling["seed"] = args.seed

    def fresh() -> list[dict]:
        return [{"role": "system", "content": args.system}] if args.system else []

    history = fresh()
    mcp_note = f", {len(mcp_specs)} from MCP" if mcp_specs else ""
    print(f"chatting with {getattr(model, 'name', args.model)}"
          f"{f' ({len(tools)} tools{mcp_note})' if tools else ''}; /reset clears, /exit or Ctrl-D leaves", file=stdout)
    try:
        while True:
            line = _read("you> ", stdin, stdout)
            if line is None:
                return 0
            cmd = line.strip()
            if not cmd:
                continue
            if cmd in ("/exit", "/quit"):
                return 0
            if cmd == "/reset":
                history = fresh()
                print("(history cleared)", file=stdout)
                continue
            if cmd.startswith("/") and cmd.split()[0] in ("/help", "/?"):
                print("/reset clears the history, /exit leaves", file=stdout)
                continue
            turn_start = len(history)
            history.append({"role": "user", "content": line})
            for _ in range(max(1, args.max_tool_rounds)):
                try:
                    reply = model.chat(history, tools=tools, **sampling)[0]
                except Exception as e:  # noqa: BLE001 - keep the session alive
                    print(f"error: {type(e).__name__}: {e}", file=stdout)
                    del history[turn_start:]
                    break
                history.append(reply.message())
                if reply.content:
                    print(f"assistant> {reply.content}", file=stdout)
                if not reply.tool_calls:
                    break
                for call in reply.tool_calls:
                    fn = call.get("function", {})
                    name, arguments = fn.get("name", "?"), fn.get("arguments", "{}")
                    print(f"tool call> {name}({arguments})", file=stdout)
                    stdout.flush()
                    if name in mcp_routes:
                        result = _call_mcp(mcp_routes[name], name, arguments)
                        print(f"tool result> {result}", file=stdout)
                    elif args.no_interactive_tools:
                        result = NO_EXECUTOR
                        print(f"tool result> {result}", file=stdout)
                    else:
                        got = _read(f"result for {name} (empty = {NO_EXECUTOR})> ", stdin, stdout)
                        if got is None:
                            return 0
                        result = got or NO_EXECUTOR
                    history.append({"role": "tool", "tool_call_id": call.get("id", ""), "name": name,
                                    "content": result})
            else:
                print(f"(stopped after {args.max_tool_rounds} tool rounds)", file=stdout)
    except KeyboardInterrupt:
        print(file=stdout)
        return 0
    finally:
        for server in servers:
            server.close()
        model.close()
