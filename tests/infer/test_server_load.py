"""Load on the real server with the real engine: 32 concurrent clients, 8 of which disconnect mid-request (4
streaming, 4 not). Every other client is served, the abandoned requests' engine work is aborted (the engine
goes idle long before they could have finished), the reserved work returns to zero, and the process's resident
memory stays flat over repeated rounds."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

import torch  # noqa: E402

from openk2.infer.server import create_app  # noqa: E402
from tests.infer.test_server import MODEL, _Server, checkpoint  # noqa: E402, F401

LONG = 400  # tokens each abandoned sample asks for; the prompt below runs greedily to this length
PROMPT = [{"role": "user", "content": "1 + 2 = 3. 4 + 5 = 9. What is 7 + 8?"}]
ROUNDS = 3


@pytest.fixture(scope="module")
def loaded(checkpoint):  # noqa: F811 - the shared session fixture
    from openk2.data.tokenizer import K2Tokenizer
    from openk2.infer.engine import Engine
    from openk2.model import K2ForCausalLM

    class CountingEngine(Engine):
        steps = 0

        def step(self):
            CountingEngine.steps += 1
            return super().step()

    torch.set_num_threads(1)
    model = K2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, device="cpu").eval()
    tok = K2Tokenizer.load(checkpoint)
    engine = CountingEngine(model, tokenizer=tok, max_batch_size=8, max_seq_len=512)
    app = create_app((engine, tok), model_name=MODEL, max_tokens_limit=LONG)
    srv = _Server(app)
    srv.engine, srv.budget, srv.counter = engine, app.state.service.budget, CountingEngine
    srv.client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield srv
    srv.close()


def _abandon(port: int, stream: bool, opened: threading.Event, close: threading.Event) -> None:
    """Ask for a long greedy answer (n=2), wait until told, then drop the connection without reading it."""
    body = json.dumps({"model": MODEL, "messages": PROMPT, "n": 2, "max_tokens": LONG, "temperature": 0,
                       "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        if stream:
            sock.recv(4096)  # the opening chunk: the request is being generated
        opened.set()
        close.wait(60)


def _serve(client, stream: bool, results: list, i: int) -> None:
    try:
        kw = {"model": MODEL, "messages": [{"role": "user", "content": f"Hello {i}"}], "max_tokens": 8}
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            results[i] = any(c.choices and c.choices[0].finish_reason for c in chunks)
        else:
            results[i] = client.chat.completions.create(**kw).choices[0].finish_reason is not None
    except Exception as err:  # noqa: BLE001 - reported by the assertion below
        results[i] = err


def _wait(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.01)
    return predicate()


def _round(srv) -> dict:
    start_steps = srv.counter.steps
    close = threading.Event()
    opened = [threading.Event() for _ in range(8)]
    quitters = [threading.Thread(target=_abandon, args=(srv.port, k % 2 == 1, opened[k], close)) for k in range(8)]
    for t in quitters:
        t.start()
    assert all(e.wait(60) for e in opened)
    assert _wait(lambda: srv.budget.in_flight >= 8 * 2 * LONG), "the abandoned requests were not all admitted"
    results: list = [None] * 24
    served = [threading.Thread(target=_serve, args=(srv.client, i % 2 == 1, results, i)) for i in range(24)]
    t0 = time.perf_counter()
    for t in served:
        t.start()
    close.set()  # the 8 quitters drop their connections while the 24 others are being served
    for t in served + quitters:
        t.join(120)
    served_s = time.perf_counter() - t0
    assert _wait(lambda: not srv.engine.has_unfinished() and srv.budget.in_flight == 0), "work left behind"
    return {"results": results, "steps": srv.counter.steps - start_steps, "served_s": served_s,
            "rss": psutil.Process().memory_info().rss}


@pytest.mark.slow
def test_32_clients_8_disconnecting_all_others_served_work_freed_memory_flat(loaded):
    # Precondition: the abandoned prompt really runs to LONG tokens greedily, so only an abort can end it early.
    probe = loaded.client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=LONG, temperature=0)
    assert probe.choices[0].finish_reason == "length" and probe.usage.completion_tokens == LONG
    rounds = [_round(loaded) for _ in range(ROUNDS)]
    for r in rounds:
        assert r["results"] == [True] * 24, r["results"]
        # 16 abandoned greedy samples of LONG tokens would need >= LONG engine steps to end by themselves
        assert r["steps"] < LONG // 2, r["steps"]
    growth_mib = (rounds[-1]["rss"] - rounds[0]["rss"]) / 2**20
    print(f"\nsteps per round {[r['steps'] for r in rounds]}, served in {[round(r['served_s'], 2) for r in rounds]} s, "
          f"RSS after each round {[round(r['rss'] / 2**20, 1) for r in rounds]} MiB, growth {growth_mib:.1f} MiB")
    assert growth_mib < 16, f"resident memory grew {growth_mib:.1f} MiB over {ROUNDS - 1} rounds"
