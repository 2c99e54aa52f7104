"""A real OpenAI-compatible HTTP endpoint in a thread, answering with any `ChatModel`, that tests start and stop.

`FakeEndpoint(model).start(port)` serves `GET /v1/models` and `POST /v1/chat/completions` (non-streaming) over a
real socket, so the official `openai` client (and its retries) runs unchanged; `stop()` closes the port, so the
next request is refused. `fail_next(k, status)` answers the next k chat requests with that HTTP status.
HTTP/1.0 (one request per connection), so a stopped endpoint keeps no live connection behind.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from openk2.llm.base import ChatModel


def free_port() -> int:
    """A local TCP port nobody listens on (right now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeEndpoint:
    """`model` behind `http://127.0.0.1:PORT/v1`; `requests` counts chat requests (failed ones included)."""

    def __init__(self, model: ChatModel, model_id: str = "fake") -> None:
        self.model = model
        self.model_id = model_id
        self.requests = 0
        self._fail: list[int] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def fail_next(self, count: int, status: int = 503) -> None:
        with self._lock:
            self._fail += [status] * count

    def start(self, port: int = 0) -> str:
        """Listen on `port` (0: any) and return the base URL (`.../v1`)."""
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, {"object": "list", "data": [{"id": endpoint.model_id, "object": "model",
                                                             "created": 0, "owned_by": "test"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with endpoint._lock:
                    endpoint.requests += 1
                    status = endpoint._fail.pop(0) if endpoint._fail else None
                if status is not None:
                    self._send(status, {"error": {"message": f"injected {status}", "type": "server_error"}})
                    return
                self._send(200, endpoint.completion(body))

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:  # a client that gave up: not our failure
                pass

        self._server = Server(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def completion(self, body: dict) -> dict:
        """The chat.completion object for one request body."""
        sampling = {k: body[k] for k in ("temperature", "top_p", "max_tokens", "seed") if k in body}
        replies = self.model.chat(body["messages"], body.get("tools"), **sampling)
        choices = []
        for i, r in enumerate(replies):
            message = {"role": "assistant", "content": r.content}
            if r.tool_calls:
                message["tool_calls"] = r.tool_calls
            choices.append({"index": i, "message": message, "finish_reason": r.finish_reason or "stop"})
        tokens = sum(r.usage.get("completion_tokens", 0) for r in replies)
        return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": self.model_id,
                "choices": choices,
                "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}}

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
