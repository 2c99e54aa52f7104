"""Bounded work per client on the real server (uvicorn on 127.0.0.1): n x max_tokens limits per request (400)
and in flight (429), a non-streaming client that disconnects gets its engine work aborted, and hostile JSON
(100k levels deep) is a 400. The engine is a scripted one that can be held, so "the request could not have
finished by itself" is certain, not a matter of timing."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from openk2.infer.admission import WorkBudget  # noqa: E402
from openk2.infer.server import create_app  # noqa: E402
from tests.infer.test_server import HELLO, MODEL, ScriptedEngine, _Server, checkpoint  # noqa: E402, F401


class HeldEngine(ScriptedEngine):
    """The scripted engine, whose steps make no progress while `held` is set (requests stay unfinished)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.script = "Fine, thanks.<|im_end|>"
        self.held = threading.Event()

    def step(self):
        if self.held.is_set():
            time.sleep(0.002)
            return []
        return super().step()


@pytest.fixture(scope="module")
def held(checkpoint):  # noqa: F811 - the shared session fixture
    from openk2.data.tokenizer import K2Tokenizer

    tok = K2Tokenizer.load(checkpoint)
    engine = HeldEngine(tok)
    app = create_app((engine, tok), model_name=MODEL, max_request_work=100, max_inflight_work=150)
    srv = _Server(app)
    srv.engine, srv.budget = engine, app.state.service.budget
    srv.client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=30)
    yield srv
    engine.held.clear()
    srv.close()


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def _raw_request(port: int, body: dict) -> socket.socket:
    """A client that sends one request and never reads the answer (the test closes it)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def test_per_request_work_limit_is_a_400(held):
    with pytest.raises(openai.BadRequestError, match=r"3 x 40 = 120 tokens.*per-request limit of 100") as info:
        held.client.chat.completions.create(model=MODEL, messages=HELLO, n=3, max_tokens=40)
    assert info.value.body["code"] == "request_too_large" and info.value.body["param"] == "max_tokens"
    r = held.client.chat.completions.create(model=MODEL, messages=HELLO, n=2, max_tokens=40)
    # The engine thread releases the work when it is done, which may be just after the answer went out.
    assert len(r.choices) == 2 and _wait(lambda: held.budget.in_flight == 0)


def test_work_in_flight_over_the_server_limit_is_a_429_until_it_drains(held):
    held.engine.held.set()
    with httpx.Client(timeout=30) as http:
        first = threading.Thread(target=lambda: http.post(held.base + "/v1/chat/completions", json={
            "model": MODEL, "messages": HELLO, "n": 2, "max_tokens": 50}))
        first.start()
        assert _wait(lambda: held.budget.in_flight == 100)
        with pytest.raises(openai.RateLimitError, match="server is busy") as info:
            held.client.chat.completions.create(model=MODEL, messages=HELLO, n=1, max_tokens=60)
        assert info.value.body["code"] == "server_busy"
        small = held.client.chat.completions.with_raw_response  # 100 + 50 fits under 150: admitted
        held.engine.held.clear()
        assert small.create(model=MODEL, messages=HELLO, max_tokens=50).status_code == 200
        first.join(timeout=30)
    assert _wait(lambda: held.budget.in_flight == 0)
    assert held.client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=60).choices


@pytest.mark.parametrize("stream", [False, True])
def test_disconnected_client_frees_its_engine_work(held, stream):
    """The engine is held, so only an abort can empty it: the request was admitted, the client closed the
    connection, and within seconds the engine holds nothing and the reserved work is back."""
    held.engine.held.set()
    try:
        sock = _raw_request(held.port, {"model": MODEL, "messages": HELLO, "n": 2, "max_tokens": 50,
                                        "stream": stream})
        assert _wait(lambda: held.budget.in_flight == 100 and held.engine.has_unfinished())
        if stream:  # a streaming client first gets its opening chunk
            assert b"data: " in sock.recv(4096)
        sock.close()
        assert _wait(lambda: not held.engine.has_unfinished() and held.budget.in_flight == 0), \
            "the abandoned request still holds engine work"
    finally:
        held.engine.held.clear()
    assert held.client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5).choices


def test_json_nested_100k_deep_is_a_400_not_a_500(held):
    deep = b'{"model": "%s", "messages": ' % MODEL.encode() + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for body in (deep, json.dumps({"model": MODEL, "messages": HELLO, "x": _nest(70)}).encode()):
        r = httpx.post(held.base + "/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_json" and "nested deeper" in r.json()["error"]["message"]
    assert held.client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5).choices


def _nest(depth: int):
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_budget_rejects_nonsense_limits():
    with pytest.raises(ValueError, match="must be positive"):
        WorkBudget(0, 10)
    with pytest.raises(ValueError, match="could never be admitted"):
        WorkBudget(100, 10)
    budget = WorkBudget(None, None)
    assert not budget.too_big(10**9) and budget.reserve(10**9) and budget.in_flight == 10**9
