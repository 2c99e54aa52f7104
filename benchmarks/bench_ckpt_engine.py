"""Checkpoint-engine broadcast bandwidth on gloo against a memory-copy ceiling, for 2 and 4 processes.

Rank 0 plays the training engine and owns a synthetic parameter set (equal-size tensors, half fp32 and half
bf16, as a mixed-precision checkpoint would be); every other rank is an inference worker that copies every
tensor into its own preallocated parameters. Reported: seconds per full update (median over repeats, the
slowest rank each time), GB/s of parameters delivered to each receiver, and the ratio to the single-process
memory-copy bandwidth (`dst.copy_(src)` of the same bytes), the ceiling for any CPU transport.

    python benchmarks/bench_ckpt_engine.py --total-mb 256 --worlds 2 4 --bucket-mb 32 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_summary, median_time  # noqa: E402

from openk2.rl.ckpt_engine import CheckpointEngine, copy_into  # noqa: E402

TENSOR_MB = 8  # each synthetic parameter; K2's largest single tensors (embedding, lm_head) are ~2.3 GB in bf16


def _params(total_mb: int) -> dict[str, torch.Tensor]:
    """The same synthetic parameters in every process (seeded), so receivers can check what arrived."""
    torch.manual_seed(0)
    count = max(1, total_mb // TENSOR_MB)
    out = {}
    for i in range(count):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        numel = (TENSOR_MB << 20) // dtype.itemsize
        out[f"layer.{i}.weight"] = torch.randn(numel // 1024, 1024).to(dtype)
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        params = _params(args.total_mb)
        local = params if rank == 0 else {}
        dest = {n: torch.empty_like(t) for n, t in params.items()}
        engine = CheckpointEngine(bucket_bytes=args.bucket_mb << 20)
        times = []
        for i in range(args.repeats + 1):  # the first update builds the plan and buffers: untimed
            dist.barrier()
            stats = engine.broadcast(local, copy_into(dest))
            if i:
                times.append(stats.seconds)
        if rank:
            out[rank] = (times, stats.bytes, all(torch.equal(dest[n], params[n]) for n in params))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def memcpy_gb_s(total_mb: int, repeats: int) -> float:
    src = torch.randn((total_mb << 20) // 4)
    dst = torch.empty_like(src)
    seconds, _ = median_time(lambda: dst.copy_(src), repeats)
    return src.nbytes / seconds / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mb", type=int, default=256, help="parameter bytes per update (MiB)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="process counts to run")
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_summary())
    ceiling = memcpy_gb_s(args.total_mb, args.repeats)
    print(f"memory copy (1 thread, {args.total_mb} MiB): {ceiling:.2f} GB/s")
    print(f"{'processes':>9} {'receivers':>9} {'s/update':>9} {'GB/s each':>10} {'vs memcpy':>9} {'bit-exact':>9}")
    for world in args.worlds:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_worker, args=(world, _free_port(), args, out), nprocs=world, join=True)
            results = dict(out)
        per_repeat = [max(results[r][0][i] for r in results) for i in range(args.repeats)]  # slowest rank
        seconds = statistics.median(per_repeat)
        nbytes = next(iter(results.values()))[1]
        exact = all(v[2] for v in results.values())
        rate = nbytes / seconds / 1e9
        print(f"{world:>9} {world - 1:>9} {seconds:>9.3f} {rate:>10.2f} {rate / ceiling:>9.2f} {exact!s:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
