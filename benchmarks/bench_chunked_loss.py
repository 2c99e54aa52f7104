"""Peak memory and time of one training step with the plain loss against the chunked loss (train.loss_chunk_tokens).

Each measurement is a fresh subprocess that builds the preset's model (fp32, or bf16 weights), runs one
untimed warm-up step on a shorter batch, then one timed step (zero grads, forward with labels, backward) on a
`--batch-size x --seq-len` batch, and reports its wall time and the process's peak resident set size
(`ru_maxrss`: model, activations, logits and gradients; everything else in the process is the same for both
variants). Variants alternate, `--repeats` times each; medians are printed.

Usage: python benchmarks/bench_chunked_loss.py --preset tiny --batch-size 1 --seq-len 16384 --chunk 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def one_step(preset: str, batch: int, seq_len: int, chunk: int, dtype: str) -> dict[str, float]:
    """Run the warm-up and the timed step in this process; returns seconds and peak RSS in MiB."""
    from openk2 import K2ForCausalLM, ModelConfig

    torch.set_num_threads(1)
    cfg = ModelConfig.preset(preset)
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings, seq_len))
    torch.manual_seed(0)
    model = K2ForCausalLM(cfg).train()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.loss_chunk_tokens = chunk
    gen = torch.Generator().manual_seed(1)
    warm = torch.randint(0, cfg.vocab_size, (1, 64), generator=gen)
    model(warm, labels=warm).loss.backward()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen)
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = model(ids, labels=ids).loss
    loss.backward()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "loss": loss.item()}


def main() -> None:
    """Alternate plain and chunked steps in subprocesses and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=4096, help="train.loss_chunk_tokens of the chunked variant")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(one_step(args.preset, args.batch_size, args.seq_len, args.child, args.dtype)))
        return
    if args.chunk < 1 or args.repeats < 1:
        raise ValueError("--chunk and --repeats must be >= 1")
    results: dict[str, list[dict[str, float]]] = {"plain": [], "chunked": []}
    for _ in range(args.repeats):
        for name, chunk in (("plain", 0), ("chunked", args.chunk)):
            cmd = [sys.executable, __file__, "--preset", args.preset, "--batch-size", str(args.batch_size),
                   "--seq-len", str(args.seq_len), "--dtype", args.dtype, "--child", str(chunk)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
    tokens = args.batch_size * args.seq_len
    print(f"preset {args.preset}, {args.dtype}, batch {args.batch_size} x {args.seq_len} = {tokens} tokens, "
          f"chunk {args.chunk} tokens, 1 thread, median of {args.repeats} alternating subprocess runs")
    for name, runs in results.items():
        peak = statistics.median(r["peak_mib"] for r in runs)
        secs = statistics.median(r["seconds"] for r in runs)
        peaks = ", ".join(f"{r['peak_mib']:,.0f}" for r in runs)
        print(f"{name:<8} peak RSS {peak:,.0f} MiB  step {secs:.2f} s  loss {runs[0]['loss']:.6f}  (peaks {peaks})")


if __name__ == "__main__":
    main()
