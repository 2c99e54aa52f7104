"""`openk2 sandbox serve`: the code-execution sandbox as an HTTP service (bearer token required)."""

from __future__ import annotations

import argparse
import os

from openk2.agentic.sandbox_service import DEFAULT_MAX_REQUEST_BYTES, TOKEN_ENV, ServerLimits, create_app, resolve_token


def sandbox_main(argv: list[str] | None = None) -> int:
    """`openk2 sandbox serve [--host 127.0.0.1] [--port 8100] [--token T] [--max-concurrency N] ...`."""
    parser = argparse.ArgumentParser(prog="openk2 sandbox", description="Code-execution sandbox service")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve POST /run over HTTP (bearer token required)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8100)
    serve.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                       help=f"bearer token clients must send (default ${TOKEN_ENV}; unset: generate and print one)")
    serve.add_argument("--max-concurrency", type=int, default=None, help="children at once (default: CPU count)")
    serve.add_argument("--max-timeout-s", type=float, default=ServerLimits.max_timeout_s)
    serve.add_argument("--max-memory-mb", type=int, default=ServerLimits.max_memory_mb)
    serve.add_argument("--max-file-mb", type=int, default=ServerLimits.max_file_mb)
    serve.add_argument("--max-processes", type=int, default=ServerLimits.max_processes,
                       help="child processes a run may start (default 0; each escapes the audit hook)")
    serve.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    serve.add_argument("--insecure", action="store_true",
                       help="run without the kernel layers (no bubblewrap, seccomp or cgroups): trusted code only")
    serve.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    token = resolve_token(args.token)
    limits = ServerLimits(max_timeout_s=args.max_timeout_s, max_memory_mb=args.max_memory_mb,
                          max_file_mb=args.max_file_mb, max_processes=args.max_processes,
                          max_request_bytes=args.max_request_bytes)
    app = create_app(token, args.max_concurrency, limits, insecure=args.insecure)
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
