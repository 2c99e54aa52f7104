"""The sandbox as a service: `openk2 sandbox serve` (FastAPI) and `SandboxClient`, a drop-in for `run_python`.

The report deploys heavy RL environments "as dedicated scalable services" shared by many concurrent rollouts
(RL infrastructure, agentic rollout); its coding sandbox runs on Kubernetes with 10k+ concurrent instances
(section 3.2.1). This is the one-machine version: `POST /run` with
{code, tests, timeout_s, memory_mb, ...} returns a SandboxResult as JSON. A shared bearer token is always
required on every route (one is generated and printed when none is given); the server binds to loopback unless told
otherwise; request bodies are bounded and every limit is clamped to the server's maxima; a SandboxPool caps
how many children run at once, so extra requests queue.

    POST /run   Authorization: Bearer T   {"code": "...", "tests": "...", "timeout_s": 5, "memory_mb": 256}
    GET  /health  Authorization: Bearer T  {"status": "ok", "max_concurrency": 8}

Every route needs the token (401 without it; /docs and /openapi.json too); a body that is not a JSON object
is 400, one with wrong fields 422, one too large 413; a missing sandbox layer is 503.
"""

import json
import secrets
import sys
from dataclasses import dataclass
from typing import Any

from openk2.agentic.sandbox import SandboxPool, SandboxResult, SandboxUnavailableError, check_sandbox

TOKEN_ENV = "OPENK2_SANDBOX_TOKEN"
DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # code + tests + stdin; a coding task's solution is a few KB


@dataclass(frozen=True)
class ServerLimits:
    """The most any request may ask for; larger requests are clamped down, not refused."""

    max_timeout_s: float = 60.0
    max_memory_mb: int = 2048
    max_file_mb: int = 64
    max_processes: int = 0  # each child process may run any binary: only raise this inside a container
    max_output_bytes: int = 256 << 10
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_disk_mb: int = 256
    max_cpus: float = 1.0

    def clamp(self, request: dict[str, Any]) -> dict[str, Any]:
        """`run_python` keyword arguments from a validated request, each limit at most the server's."""
        kwargs = dict(request)
        kwargs["timeout_s"] = min(kwargs["timeout_s"], self.max_timeout_s)
        kwargs["memory_mb"] = min(kwargs["memory_mb"], self.max_memory_mb)
        kwargs["max_file_mb"] = min(kwargs["max_file_mb"], self.max_file_mb)
        kwargs["max_processes"] = min(kwargs["max_processes"], self.max_processes)
        kwargs["max_output_bytes"] = min(kwargs["max_output_bytes"], self.max_output_bytes)
        kwargs["max_disk_mb"] = min(kwargs["max_disk_mb"], self.max_disk_mb)
        kwargs["cpus"] = min(kwargs["cpus"], self.max_cpus)
        if kwargs["cpu_time_s"] is not None:
            kwargs["cpu_time_s"] = min(kwargs["cpu_time_s"], self.max_timeout_s)
        return kwargs


def create_app(token: str, max_concurrency: int | None = None, limits: ServerLimits | None = None,
               insecure: bool = False) -> Any:
    """The FastAPI app; every route (/health, /docs and /openapi.json too) wants `Authorization: Bearer <token>`.

    Refuses to build (SandboxUnavailableError) where a kernel layer of the sandbox is missing, unless
    `insecure` (trusted code only: every run then goes without the kernel layers)."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, Field, ValidationError

    if not token:
        raise ValueError("the sandbox service needs a non-empty token")
    if not insecure:
        check_sandbox()  # fail at start-up, naming the missing layer, not on the first request
    limits = limits or ServerLimits()
    pool = SandboxPool(max_concurrency)

    class RunRequest(BaseModel, extra="forbid"):
        code: str
        tests: str | None = None
        timeout_s: float = Field(10.0, gt=0)
        memory_mb: int = Field(512, ge=64)
        cpu_time_s: float | None = Field(None, gt=0)
        max_file_mb: int = Field(16, ge=1)
        max_processes: int = Field(0, ge=0)
        max_output_bytes: int = Field(64 << 10, ge=0)
        max_disk_mb: int = Field(64, ge=1)
        cpus: float = Field(1.0, ge=0.01)
        stdin: str = ""
        setup: str | None = None
        entry_points: list[str] | None = None

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        pool.close()

    app = FastAPI(title="openk2 sandbox", lifespan=lifespan)

    def token_ok(request: Request) -> bool:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), token.encode())

    @app.middleware("http")
    async def require_token(request: Request, call_next: Any) -> Any:
        """Every path, known or not, docs included: nothing is served without the token."""
        if not token_ok(request):
            return JSONResponse({"detail": "missing or wrong token; send 'Authorization: Bearer <token>'"}, 401)
        return await call_next(request)

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length", "")
        too_big = HTTPException(413, f"request body larger than {limits.max_request_bytes} bytes")
        if length.isdigit() and int(length) > limits.max_request_bytes:
            raise too_big
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limits.max_request_bytes:
                raise too_big
        return bytes(body)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "max_concurrency": pool.max_concurrency}

    @app.post("/run")
    async def run(request: Request) -> dict:
        body = await read_body(request)
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as err:  # not UTF-8, not JSON, or nested past the parser's depth
            raise HTTPException(400, f"the body is not valid JSON: {type(err).__name__}") from None
        if not isinstance(data, dict):
            raise HTTPException(400, "the body must be a JSON object")
        try:
            job = RunRequest.model_validate(data)
        except (ValidationError, RecursionError) as err:
            detail = err.errors(include_url=False, include_context=False, include_input=False) \
                if isinstance(err, ValidationError) else "nested too deeply"
            raise HTTPException(422, detail) from None
        try:
            result = await pool.run(**limits.clamp(job.model_dump()), insecure=insecure)
        except SandboxUnavailableError as err:
            raise HTTPException(503, str(err)) from None
        return result.to_dict()

    return app


class SandboxServiceError(RuntimeError):
    """The sandbox service refused or failed a request (wrong token, bad input, server error)."""

    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"sandbox service answered {status_code}: {detail}")
        self.status_code, self.detail = status_code, detail


class SandboxClient:
    """`run_python` against a remote `openk2 sandbox serve`: same arguments, same SandboxResult."""

    def __init__(self, url: str, token: str, request_timeout_s: float = 600.0) -> None:
        import httpx

        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._timeout = request_timeout_s  # covers queueing behind other runs, not just this run's own limit
        self._client = httpx.Client(timeout=request_timeout_s)

    def run_python(self, code: str, tests: str | None = None, timeout_s: float = 10.0, memory_mb: int = 512,
                   **kwargs: Any) -> SandboxResult:
        """Run remotely; keyword arguments are those of `openk2.agentic.sandbox.run_python`."""
        payload = {"code": code, "tests": tests, "timeout_s": timeout_s, "memory_mb": memory_mb, **kwargs}
        return self._parse(self._client.post(f"{self.url}/run", json=payload, headers=self._headers))

    async def arun_python(self, code: str, tests: str | None = None, timeout_s: float = 10.0,
                          memory_mb: int = 512, **kwargs: Any) -> SandboxResult:
        """The asyncio form of `run_python`."""
        import httpx

        payload = {"code": code, "tests": tests, "timeout_s": timeout_s, "memory_mb": memory_mb, **kwargs}
        async with httpx.AsyncClient(timeout=self._timeout) as client:
            return self._parse(await client.post(f"{self.url}/run", json=payload, headers=self._headers))

    @staticmethod
    def _parse(response: Any) -> SandboxResult:
        if response.status_code != 200:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text
            raise SandboxServiceError(response.status_code, detail)
        return SandboxResult.from_dict(response.json())

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "SandboxClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def resolve_token(token: str | None) -> str:
    """The given token, or a fresh one printed to stderr: the service never runs without one."""
    if token:
        return token
    token = secrets.token_urlsafe(24)
    print(f"openk2 sandbox: no --token or ${TOKEN_ENV} given; generated token: {token}", file=sys.stderr)
    return token
