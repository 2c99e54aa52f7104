"""The sandbox service for real: `openk2 sandbox serve` in a subprocess, driven over HTTP and by SandboxClient."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from openk2.agentic.sandbox_service import SandboxClient, SandboxServiceError, resolve_token
from openk2.cli.sandbox import sandbox_main

TOKEN = "test-token-4b2e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(*args: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "openk2", "sandbox", "serve", "--port", str(port),
                             "--log-level", "warning", *args], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1, headers=AUTH).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not come up")


@pytest.fixture(scope="module")
def server():
    env = {**os.environ, "OPENK2_SANDBOX_TOKEN": TOKEN}
    proc, url = _start_server("--max-concurrency", "2", "--max-timeout-s", "2", "--max-request-bytes", "4096",
                              env=env)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_requests_without_the_token_get_401(server):
    assert httpx.post(f"{server}/run", json={"code": "print(1)"}).status_code == 401
    for path in ("/health", "/docs", "/redoc", "/openapi.json", "/no-such-route"):  # every route, docs too
        assert httpx.get(f"{server}{path}").status_code == 401, path
    assert httpx.get(f"{server}/openapi.json", headers=AUTH).status_code == 200
    wrong = httpx.post(f"{server}/run", json={"code": "print(1)"}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    with SandboxClient(server, "nope") as client, pytest.raises(SandboxServiceError) as err:
        client.run_python("print(1)")
    assert err.value.status_code == 401


def test_client_runs_code_and_tests_like_the_local_sandbox(server):
    with SandboxClient(server, TOKEN) as client:
        result = client.run_python("def sq(x):\n    return x * x\n", "def test_sq():\n    assert sq(3) == 9\n"
                                   "def test_bad():\n    assert sq(2) == 5\n", timeout_s=5, memory_mb=256)
    assert (result.passed, result.failed, result.killed_reason) == (1, 1, None)
    assert [t.status for t in result.tests] == ["passed", "failed"]


def test_limits_are_clamped_and_bad_input_refused(server):
    with SandboxClient(server, TOKEN) as client:
        result = client.run_python("while True:\n    pass\n", timeout_s=100)
        assert result.killed_reason == "wall-time limit 2 s exceeded"  # the server's --max-timeout-s
        with pytest.raises(SandboxServiceError) as bad:
            client.run_python("print(1)", timeout_s=-1)
        assert bad.value.status_code == 422
        with pytest.raises(SandboxServiceError) as big:
            client.run_python("x = 1\n" * 1000)
        assert big.value.status_code == 413


def test_concurrent_requests_are_all_answered(server):
    client = SandboxClient(server, TOKEN)

    async def many():
        return await asyncio.gather(*(client.arun_python(f"print({i} * 2)") for i in range(6)))

    results = asyncio.run(many())
    client.close()
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(6)]
    assert all(r.killed_reason is None for r in results)


def test_a_token_is_generated_and_printed_when_none_is_given(capsys):
    token = resolve_token(None)
    assert len(token) >= 32 and f"generated token: {token}" in capsys.readouterr().err
    assert resolve_token("given") == "given"


def test_cli_rejects_bad_concurrency():
    with pytest.raises(ValueError, match="max-concurrency"):
        sandbox_main(["serve", "--max-concurrency", "0"])


def test_malformed_bodies_get_400_and_the_server_keeps_serving(server):
    bodies = [b"{not json", b"\xff\xfe garbage", b"[1, 2]", b"null", b"[" * 4000, b"{\"a\":" * 800, b""]
    for body in bodies:
        response = httpx.post(f"{server}/run", content=body, headers={**AUTH, "content-type": "application/json"})
        assert response.status_code == 400, (body[:20], response.status_code, response.text[:200])
    wrong_field = httpx.post(f"{server}/run", json={"code": "print(1)", "insecure": True}, headers=AUTH)
    assert wrong_field.status_code == 422  # no request can switch the kernel layers off
    with SandboxClient(server, TOKEN) as client:
        assert client.run_python("print(7)").stdout == "7\n"
