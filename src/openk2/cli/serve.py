"""`openk2 serve`: the OpenAI-compatible chat server for a checkpoint, under uvicorn (see docs/serving.md)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from openk2.infer.server import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TOKENS_LIMIT, create_app

log = logging.getLogger("openk2.serve")


def serve_main(argv: Sequence[str] | None = None) -> int:
    """`openk2 serve --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--model-name NAME]`."""
    p = argparse.ArgumentParser(prog="openk2 serve", description="OpenAI-compatible chat server for a checkpoint")
    p.add_argument("--checkpoint", required=True, help="directory with config.json, safetensors, tokenizer")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("OPENK2_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $OPENK2_API_KEY; unset = no auth)")
    p.add_argument("--model-name", default=None, help="model id clients must send (default: checkpoint dir name)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--max-tokens-limit", type=int, default=DEFAULT_MAX_TOKENS_LIMIT)
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    if not Path(args.checkpoint).is_dir():
        p.error(f"--checkpoint {args.checkpoint} is not a directory")

    import uvicorn

    app = create_app(args.checkpoint, model_name=args.model_name, api_key=args.api_key,
                     max_request_bytes=args.max_request_bytes, max_tokens_limit=args.max_tokens_limit,
                     max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, device=args.device,
                     dtype=args.dtype)
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        log.warning("serving on %s without an API key", args.host)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
