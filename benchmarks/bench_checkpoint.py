"""Checkpoint save/load time and bytes: DCP shards (every rank writes its own) vs the old path (rank 0 gathers
the model into HF safetensors, every rank torch.saves its optimizer state), at world 1 and 2 (gloo, dp=2 ZeRO-1).

Usage: python benchmarks/bench_checkpoint.py [--preset tiny] [--repeats 3] [--worlds 1 2]
The model gets one optimizer step on random gradients so the Muon/AdamW state exists. Times are medians over
`--repeats` saves (and loads) into a fresh directory on the same disk as the temp dir; bytes are the files written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from openk2.config import ModelConfig  # noqa: E402
from openk2.model import K2ForCausalLM  # noqa: E402


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _step(model, optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    if hasattr(optimizer, "reduce_gradients"):
        optimizer.reduce_gradients()
    optimizer.step(None)
    optimizer.zero_grad()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _timed(fn) -> float:
    _barrier()
    start = time.perf_counter()
    fn()
    _barrier()
    return time.perf_counter() - start


def _measure(cfg: ModelConfig, world: int, rank: int, root: Path, repeats: int) -> dict:
    from openk2.optim.muonclip import MuonClip
    from openk2.train.dcp import DCP_DIR, load_state, save_state
    from openk2.train.dcp_state import model_entries, optimizer_entries
    from openk2.train.parallel.config import ParallelConfig
    from openk2.train.parallel.mesh import init_parallel
    from openk2.train.parallel.state import gather_full_state, load_full_state, save_full_model
    from openk2.train.parallel.zero import DistributedMuonClip

    torch.manual_seed(0)
    model = K2ForCausalLM(cfg)
    named = list(model.named_parameters())
    kwargs = {"lr": 1e-3, "ns_dtype": torch.float32}
    if world == 1:
        optimizer, mesh, group = MuonClip(model, **kwargs), None, None
    else:
        mesh = init_parallel(ParallelConfig(dp=world, backend="gloo"), torch.device("cpu"))
        optimizer = DistributedMuonClip(model, named, dict(enumerate(model.attention_layers())), **kwargs,
                                        dense_group=mesh.group("data"), expert_group=mesh.group("dp"))
        group = dist.new_group(backend="gloo")
    _step(model, optimizer)

    def entries(fresh: bool):
        optim, install = optimizer_entries(optimizer, named, fresh=fresh)
        return {**model_entries(model.state_dict(keep_vars=True)), **optim}, install

    def old_save(path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        if world == 1:
            model.save_pretrained(path)
        else:
            full = gather_full_state(model, mesh)
            if rank == 0:
                save_full_model(full, cfg, path)
        torch.save(optimizer.state_dict(), path / f"optimizer-{rank}.pt")

    def old_load(path: Path) -> None:
        loaded = K2ForCausalLM.from_pretrained(path, dtype=torch.float32)
        if world == 1:
            model.load_state_dict(loaded.state_dict())
        else:
            load_full_state(model, loaded.state_dict(), mesh)
        optimizer.load_state_dict(torch.load(path / f"optimizer-{rank}.pt", weights_only=False))

    def new_save(path: Path) -> None:
        save_state(entries(False)[0], path / DCP_DIR, group)

    def new_load(path: Path) -> None:
        state, install = entries(True)
        load_state(state, path / DCP_DIR, group)
        install()

    out = {}
    for name, save, load in (("old", old_save, old_load), ("dcp", new_save, new_load)):
        saves, loads, size = [], [], 0
        for i in range(repeats):
            path = root / f"{name}-{i}"
            saves.append(_timed(lambda path=path, save=save: save(path)))
            loads.append(_timed(lambda path=path, load=load: load(path)))
            size = _bytes(path) if rank == 0 else 0
            _barrier()
            if rank == 0:
                shutil.rmtree(path)
        out[name] = {"save_s": statistics.median(saves), "load_s": statistics.median(loads), "bytes": size}
    return out


def _entry(rank: int, world: int, port: int, cfg_dict: dict, root: str, repeats: int, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        measured = _measure(ModelConfig(**cfg_dict), world, rank, Path(root), repeats)
        if rank == 0:
            results[world] = measured
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    cfg = ModelConfig.preset(args.preset)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    results = {}
    try:
        for world in args.worlds:
            if world == 1:
                torch.set_num_threads(1)
                results[1] = _measure(cfg, 1, 0, root, args.repeats)
                continue
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            with mp.Manager() as manager:
                shared = manager.dict()
                mp.spawn(_entry, args=(world, port, cfg.__dict__, str(root), args.repeats, shared), nprocs=world)
                results[world] = dict(shared)[world]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"preset {args.preset}, median of {args.repeats}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"{'world':>5} {'path':>4} {'save s':>8} {'load s':>8} {'MB':>8}")
    for world, rows in results.items():
        for name, row in rows.items():
            print(f"{world:>5} {name:>4} {row['save_s']:8.3f} {row['load_s']:8.3f} {row['bytes'] / 1e6:8.1f}")
    print(json.dumps({str(k): v for k, v in results.items()}))


if __name__ == "__main__":
    main()
