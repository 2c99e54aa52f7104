"""`openk2 serve` under load: N concurrent clients on loopback, every request answered, batching measured.

The script writes a checkpoint (random weights of a preset plus a locally trained tokenizer), starts the real
server as a subprocess (`python -m openk2 serve`), and drives it with the official `openai` client (async). For
each concurrency level C it sends `--requests` chat completions, at most C in flight at a time, each asking for
`--max-tokens` tokens (a random-weight model seldom ends a reply early; the tokens actually generated, from the
responses' usage, are what is counted). It prints, per level: requests answered and
failed, completion tokens/s over the whole level, and latency p50/p95. The ratio against C=1 is the gain from
the engine batching concurrent requests together.

Usage: python benchmarks/bench_serve_load.py --preset tiny --clients 1,4,16,64 --requests 64 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_summary  # noqa: E402

from openk2 import K2ForCausalLM, ModelConfig  # noqa: E402
from openk2.data.mathgen import math_documents  # noqa: E402
from openk2.data.tokenizer import train_tokenizer  # noqa: E402

MODEL = "bench"


def write_checkpoint(out: Path, preset: str, vocab: int) -> None:
    texts = list(math_documents(seed=0, count=400))
    train_tokenizer(texts, vocab_size=vocab).save(out)
    torch.manual_seed(0)
    K2ForCausalLM(ModelConfig.preset(preset).replace(vocab_size=vocab)).save_pretrained(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(checkpoint: Path, port: int, max_batch: int, threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "openk2", "serve", "--checkpoint", str(checkpoint), "--port", str(port),
           "--model-name", MODEL, "--max-batch-size", str(max_batch), "--max-seq-len", "512",
           "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start within 120 s")


async def one_level(base: str, clients: int, requests: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(clients)
    latencies: list[float] = []
    tokens, failures = 0, 0

    async def ask(i: int) -> None:
        nonlocal tokens, failures
        async with gate:
            start = time.perf_counter()
            try:
                resp = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}],
                    max_tokens=max_tokens, temperature=1.0, seed=i)
            except Exception as err:  # noqa: BLE001 - counted and shown, the level goes on
                failures += 1
                print(f"  request {i} failed: {err!r}", file=sys.stderr)
                return
            latencies.append(time.perf_counter() - start)
            tokens += resp.usage.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*(ask(i) for i in range(requests)))
    elapsed = time.perf_counter() - start
    await client.close()
    latencies.sort()
    return {"clients": clients, "answered": len(latencies), "failed": failures, "tok_s": tokens / elapsed,
            "p50_s": statistics.median(latencies) if latencies else float("nan"),
            "p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))] if latencies else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=ModelConfig.preset_names())
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--clients", default="1,4,16,64", help="comma-separated concurrency levels")
    p.add_argument("--requests", type=int, default=64, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=16, help="the server's engine batch")
    p.add_argument("--threads", type=int, default=2, help="torch threads in the server")
    args = p.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    # the header's torch-thread count is this client process's; the server's is --threads
    print(f"{machine_summary()} | server torch threads: {args.threads}")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "ckpt"
        write_checkpoint(checkpoint, args.preset, args.vocab)
        port = free_port()
        server = start_server(checkpoint, port, args.max_batch_size, args.threads)
        try:
            base = f"http://127.0.0.1:{port}/v1"
            asyncio.run(one_level(base, 1, 2, args.max_tokens))  # warm-up
            rows = [asyncio.run(one_level(base, c, args.requests, args.max_tokens)) for c in levels]
        finally:
            server.terminate()
            server.wait(timeout=30)
    base_rate = rows[0]["tok_s"]
    print(f"\n{args.preset}, {args.requests} requests per level, {args.max_tokens} tokens each, "
          f"engine batch {args.max_batch_size}")
    print(f"{'clients':>8}{'answered':>10}{'failed':>8}{'tok/s':>10}{'vs 1st':>8}{'p50 s':>8}{'p95 s':>8}")
    for r in rows:
        print(f"{r['clients']:>8}{r['answered']:>10}{r['failed']:>8}{r['tok_s']:>10.1f}"
              f"{r['tok_s'] / base_rate:>7.2f}x{r['p50_s']:>8.2f}{r['p95_s']:>8.2f}")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
