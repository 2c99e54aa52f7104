"""A scripted OpenAI-compatible chat endpoint on 127.0.0.1, for driving real HTTP clients (openai, litellm).

`ScriptedEndpoint(respond)` serves `POST /v1/chat/completions` and `GET /v1/models` from a thread; `respond(request)`
gets the parsed request body and returns the assistant message as {"content": str | None, "tool_calls": [...]}.
Requests are kept in `requests`. Use it as a context manager; `base_url` is `http://127.0.0.1:PORT/v1`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ScriptedEndpoint:
    def __init__(self, respond: Callable[[dict], dict]) -> None:
        self.respond = respond
        self.requests: list[dict] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, {"object": "list", "data": [{"id": "scripted", "object": "model", "owned_by": "t"}]})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                request = json.loads(self.rfile.read(length))
                endpoint.requests.append(request)
                try:
                    message = endpoint.respond(request)
                except Exception as exc:  # noqa: BLE001 - surfaced to the client as a 400
                    self._send(400, {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "invalid"}})
                    return
                calls = message.get("tool_calls") or None
                self._send(200, {
                    "id": f"chatcmpl-{len(endpoint.requests)}", "object": "chat.completion",
                    "created": int(time.time()),
                    "model": request.get("model", "scripted"),
                    "choices": [{"index": 0, "finish_reason": "tool_calls" if calls else "stop",
                                 "message": {"role": "assistant", "content": message.get("content"),
                                             "tool_calls": calls}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> ScriptedEndpoint:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
