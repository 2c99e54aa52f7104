"""A tiny untrained checkpoint and a real `openk2 serve` subprocess on it, for the conformance benchmark and its
CI test (random weights: what is measured is the server's conformance, not the model's judgement)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


def write_tiny_checkpoint(out: Path, seed: int = 0) -> Path:
    """A 2-layer K2 with random weights (seed) and a 768-token tokenizer trained here; long contexts allowed."""
    import torch

    from openk2.config import ModelConfig
    from openk2.data.mathgen import math_documents
    from openk2.data.tokenizer import train_tokenizer
    from openk2.model import K2ForCausalLM

    texts = list(math_documents(seed=0, count=200)) + ['{"city": "Paris", "days": 3} weather booking'] * 20
    tok = train_tokenizer(texts, vocab_size=768)
    cfg = ModelConfig.preset("tiny").replace(
        vocab_size=768, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, n_routed_experts=8, max_position_embeddings=8192)
    torch.manual_seed(seed)
    K2ForCausalLM(cfg).save_pretrained(out)
    tok.save(out)
    return out


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(checkpoint: Path, extra: Sequence[str] = (), threads: int = 1,
                 wait_s: float = 120) -> tuple[subprocess.Popen, str]:
    """`python -m openk2 serve` on the checkpoint (cpu, fp32) plus `extra` flags; (process, base URL) once
    /v1/models answers. The server's output goes to this process's stderr."""
    port = free_port()
    cmd = [sys.executable, "-m", "openk2", "serve", "--checkpoint", str(checkpoint), "--port", str(port),
           "--device", "cpu", "--dtype", "float32", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, stdout=sys.stderr)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + wait_s
    while True:
        try:
            httpx.get(base + "/v1/models", timeout=5)
            return proc, base
        except httpx.TransportError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"openk2 serve did not start (exit code {proc.poll()})") from None
            time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> None:
    """Terminate the server and wait for it."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
