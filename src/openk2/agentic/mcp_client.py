"""A small synchronous client for MCP servers started over stdio (the `mcp` SDK underneath).

`MCPServer("python -m mcp_server_time")` starts the server as a subprocess, keeps one session open, and
offers `list_tools()` (OpenAI function specs with provenance) and `call_tool(name, arguments)`. The SDK is
asyncio/anyio based and its stdio transport must be opened and closed in the same task, so the session lives
in a private event loop on a daemon thread; calls from plain code (or from another event loop, via
`acall_tool`) are handed to it. A leading `python`/`python3` in the command means this interpreter, so
servers installed in the active environment work without it being on PATH.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


def parse_command(command: str | Sequence[str]) -> list[str]:
    """The argv of a server command (a shell-like string or a list); `python` becomes `sys.executable`."""
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if not argv:
        raise ValueError("an MCP server command must not be empty")
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


@dataclass
class ToolResult:
    """What a tool call returned: the text content, the structured value if the server gave one, the error flag."""

    text: str
    structured: Any = None
    is_error: bool = False

    def as_message_content(self) -> str:
        """The result as a tool message's content: structured JSON when present, else the text."""
        if self.structured is not None:
            return json.dumps(self.structured, ensure_ascii=False)
        return self.text


class MCPServer:
    """One MCP server subprocess with an open session; use as a context manager or call `close()`."""

    def __init__(self, command: str | Sequence[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
                 timeout_s: float = 30.0, name: str | None = None) -> None:
        self.argv = parse_command(command)
        self.command = command if isinstance(command, str) else shlex.join(self.argv)
        self.name = name or _short_name(self.argv)
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp:{self.name}", daemon=True)
        self._thread.start()
        self._stop: asyncio.Event | None = None
        self._session: Any = None
        self._ready: Future = Future()
        self._runner = asyncio.run_coroutine_threadsafe(self._serve(cwd, env), self._loop)
        try:
            self._ready.result(timeout=timeout_s)
        except BaseException as err:
            self.close()
            if isinstance(err, TimeoutError):
                raise ValueError(f"MCP server {self.command!r} did not start within {timeout_s} s") from None
            raise ValueError(f"MCP server {self.command!r} failed to start: {_leaf(err)!r}") from None
        self._tools: list[dict] | None = None

    async def _serve(self, cwd: str | None, env: dict[str, str] | None) -> None:
        from mcp.client.session import ClientSession
        from mcp.client.stdio import StdioServerParameters, stdio_client

        self._stop = asyncio.Event()
        params = StdioServerParameters(command=self.argv[0], args=self.argv[1:], cwd=cwd, env=env)
        try:
            # Servers log to stderr; keep that out of the terminal and the test output.
            with open(os.devnull, "w") as errlog:
                async with stdio_client(params, errlog=errlog) as (read, write):
                    async with ClientSession(read, write) as session:
                        await session.initialize()
                        self._session = session
                        self._ready.set_result(True)
                        await self._stop.wait()
        except BaseException as err:
            if not self._ready.done():
                self._ready.set_exception(err)
            elif not isinstance(err, (asyncio.CancelledError, GeneratorExit)):
                raise

    def _run(self, coro: Any, timeout_s: float | None = None) -> Any:
        if self._session is None:
            coro.close()
            raise ValueError(f"MCP server {self.name} is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout_s or self.timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def list_tools(self) -> list[dict]:
        """The server's tools as OpenAI function specs, each with `x-mcp` provenance (server name, command)."""
        if self._tools is None:
            tools: list[dict] = []
            cursor = None
            while True:
                from mcp_types import PaginatedRequestParams

                params = PaginatedRequestParams(cursor=cursor) if cursor else None
                page = self._run(self._session.list_tools(params=params))
                tools += [self._to_openai(t) for t in page.tools]
                cursor = getattr(page, "next_cursor", None)
                if not cursor:
                    break
            self._tools = tools
        return self._tools

    def _to_openai(self, tool: Any) -> dict:
        fn: dict[str, Any] = {"name": tool.name, "description": tool.description or "",
                              "parameters": tool.input_schema or {"type": "object", "properties": {}}}
        spec: dict[str, Any] = {"type": "function", "function": fn,
                                "x-mcp": {"server": self.name, "command": self.command}}
        if getattr(tool, "output_schema", None):
            spec["x-mcp"]["returns"] = tool.output_schema
        return spec

    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.list_tools()]

    def call_tool(self, name: str, arguments: dict | None = None, timeout_s: float | None = None) -> ToolResult:
        """Call a tool for real; a server-side failure comes back as `is_error=True`, not an exception."""
        result = self._run(self._session.call_tool(name, arguments or {}), timeout_s)
        texts = [c.text for c in result.content if getattr(c, "type", None) == "text"]
        return ToolResult(text="\n".join(texts), structured=getattr(result, "structured_content", None),
                          is_error=bool(getattr(result, "is_error", False)))

    async def acall_tool(self, name: str, arguments: dict | None = None,
                         timeout_s: float | None = None) -> ToolResult:
        """`call_tool` from inside another event loop, without blocking it."""
        return await asyncio.to_thread(self.call_tool, name, arguments, timeout_s)

    def close(self) -> None:
        """End the session and the subprocess (idempotent)."""
        if self._stop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
            try:
                self._runner.result(timeout=10)
            except BaseException:  # noqa: BLE001 - shutting down; the SDK already killed the process tree
                pass
        self._session = None
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> MCPServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _leaf(err: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups, which anyio wraps everything in."""
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    return err


def _short_name(argv: list[str]) -> str:
    """A readable server name: the module after `-m`, else the executable's base name."""
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        return argv[argv.index("-m") + 1].replace("_", "-")
    return os.path.basename(argv[0])
