"""Checkpoint engine: the full parameter set goes from the ranks that hold it to every rank, bucket by bucket.

K2 report, section 4.2 ("Efficient Engine Switching"): training and inference engines shard the model
differently, so after each RL step every checkpoint worker broadcasts the *full* parameter set and each
inference worker keeps only what it needs. Broadcasting everything costs a little more than sending each worker
its own slice, but it leaves the two engines fully decoupled (neither knows the other's sharding). For a 1T model
the update is pipelined so that only a couple of buffers are in flight at a time.

Here:

* every rank passes the tensors it owns (a trainer's shard; nothing for a pure receiver), and the owners'
  names, shapes and dtypes are exchanged once (`all_gather_object`);
* tensors are packed as raw bytes (so bit-exact for any dtype, mixed dtypes share a bucket) into buckets of
  at most `bucket_bytes`, each bucket holding tensors of one owner, which is its broadcast source; a tensor
  larger than a bucket travels alone;
* two bucket buffers alternate (double buffering): while bucket i is being broadcast, bucket i-1's bytes are
  unpacked into the receivers' parameters and the owner of bucket i+1 packs it;
* every rank sees every tensor through `receive(name, tensor)` and keeps what it wants (the tensor is a view
  of a reused buffer: copy it).

The same code runs on gloo (CPU tensors) and nccl (buffers on the rank's CUDA device). `load_and_broadcast` is
the startup path: every rank reads a disjoint, byte-balanced part of a safetensors checkpoint and broadcasts it,
so the checkpoint is read exactly once however many ranks start.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from openk2.rl.sync_group import StandaloneGroup

_ALIGN = 64  # every tensor starts on a 64-byte boundary of its bucket, so a byte view can be re-viewed as any dtype
DEFAULT_BUCKET_BYTES = 64 << 20  # 64 MiB: large enough to saturate a link, small enough to double-buffer on a GPU

# safetensors dtype codes (https://github.com/huggingface/safetensors, format spec)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

Receive = Callable[[str, torch.Tensor], None]


# ---------------------------------------------------------------------- plan
@dataclass(frozen=True)
class TensorMeta:
    """What every rank knows about one tensor before its bytes arrive."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    owner: int  # the rank that holds it and broadcasts it

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """Tensors of one owner packed back to back: entries are (meta, byte offset)."""

    owner: int
    entries: tuple[tuple[TensorMeta, int], ...]
    nbytes: int


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Pack tensors into buckets of at most `bucket_bytes` (one owner per bucket, order kept within an owner).

    Every rank computes the same plan from the same metadata, so they issue the same broadcasts in the same order.
    """
    if bucket_bytes < _ALIGN:
        raise ValueError(f"bucket_bytes must be at least {_ALIGN}, got {bucket_bytes}")
    buckets: list[Bucket] = []
    for owner in sorted({m.owner for m in metas}):
        entries: list[tuple[TensorMeta, int]] = []
        used = 0
        for meta in (m for m in metas if m.owner == owner):
            size = _aligned(meta.nbytes)
            if entries and used + size > bucket_bytes:
                buckets.append(Bucket(owner, tuple(entries), used))
                entries, used = [], 0
            entries.append((meta, used))
            used += size
        if entries:
            buckets.append(Bucket(owner, tuple(entries), used))
    return buckets


def pack_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> None:
    """Copy the bucket's tensors (held by this rank) into the uint8 `buffer` at their offsets."""
    for meta, offset in bucket.entries:
        flat = tensors[meta.name].detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset: offset + meta.nbytes].copy_(flat, non_blocking=True)


def unpack_bucket(bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into `buffer`, one per tensor of the bucket (valid until the buffer is reused)."""
    for meta, offset in bucket.entries:
        raw = buffer[offset: offset + meta.nbytes]
        yield meta.name, raw.view(meta.dtype).view(meta.shape)


# ---------------------------------------------------------------------- the engine
@dataclass
class BroadcastStats:
    num_tensors: int
    num_buckets: int
    bytes: int  # parameter bytes every rank received (the full set)
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class CheckpointEngine:
    """Full-parameter broadcast over a torch.distributed group, pipelined over two bucket buffers."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 group: dist.ProcessGroup | StandaloneGroup | None = None,
                 device: str | torch.device | None = None) -> None:
        """`group`: a group of the initialised world (None: the world), or a `StandaloneGroup` outside it.
        `device`: where the bucket buffers live (CPU for gloo; this rank's CUDA device for nccl).
        Default: cuda:current when the group's backend is nccl, else cpu."""
        self.standalone = group if isinstance(group, StandaloneGroup) else None
        if self.standalone is None and not dist.is_initialized():
            raise ValueError("CheckpointEngine needs torch.distributed to be initialised (init_process_group) "
                             "or a StandaloneGroup")
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.rank = self.standalone.rank if self.standalone else dist.get_rank(group)
        if device is None:
            nccl = (self.standalone.backend if self.standalone else dist.get_backend(group)) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        self._plan_key: tuple | None = None
        self._plan: list[Bucket] = []
        self._buffers: list[torch.Tensor] = []

    def plan(self, local: Mapping[str, torch.Tensor]) -> list[Bucket]:
        """Exchange the owners' metadata and (re)build the bucket plan; cached while the metadata is unchanged."""
        mine = [(name, tuple(t.shape), t.dtype) for name, t in local.items()]
        if self.standalone is not None:
            gathered = self.standalone.all_gather_metas(mine)
        else:
            gathered = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, mine, group=self.group)
        key = tuple(tuple(x) for x in gathered)
        if key != self._plan_key:
            metas, seen = [], set()
            for owner, items in enumerate(gathered):
                for name, shape, dtype in items:
                    if name in seen:
                        raise ValueError(f"tensor {name!r} is owned by more than one rank")
                    seen.add(name)
                    metas.append(TensorMeta(name, shape, dtype, owner))
            self._plan = plan_buckets(metas, self.bucket_bytes)
            self._plan_key = key
            size = max((b.nbytes for b in self._plan), default=0)
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._plan

    def broadcast(self, local: Mapping[str, torch.Tensor], receive: Receive | None = None) -> BroadcastStats:
        """Send this rank's tensors to every rank and hand every rank's tensors to `receive(name, view)`.

        Collective: every rank of the group calls it (a pure receiver with `local={}`). Returns timing stats.
        """
        plan = self.plan(local)
        start = time.perf_counter()
        in_flight: list[tuple | None] = [None, None]  # per buffer: (work, bucket, view) of the bucket using it
        for i, bucket in enumerate(plan):
            slot = i % 2
            if in_flight[slot] is not None:  # bucket i-2 used this buffer: finish it before refilling
                self._finish(in_flight[slot], receive)
            view = self._buffers[slot][: bucket.nbytes]
            if bucket.owner == self.rank:
                pack_bucket(bucket, local, view)
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # packing copies were non-blocking
            if self.standalone is not None:
                work = self.standalone.broadcast(view, bucket.owner)
            else:
                src = bucket.owner if self.group is None else dist.get_global_rank(self.group, bucket.owner)
                work = dist.broadcast(view, src=src, group=self.group, async_op=True)
            in_flight[slot] = (work, bucket, view)
        for slot in ((len(plan)) % 2, (len(plan) + 1) % 2):  # the older bucket first
            if in_flight[slot] is not None:
                self._finish(in_flight[slot], receive)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        total = sum(m.nbytes for b in plan for m, _ in b.entries)
        return BroadcastStats(sum(len(b.entries) for b in plan), len(plan), total, seconds)

    @staticmethod
    def _finish(entry: tuple, receive: Receive | None) -> None:
        work, bucket, view = entry
        work.wait()
        if receive is not None:
            for name, tensor in unpack_bucket(bucket, view):
                receive(name, tensor)


# ---------------------------------------------------------------------- receivers
def copy_into(params: Mapping[str, torch.Tensor], keep: Callable[[str], bool] | None = None) -> Receive:
    """A `receive` that copies each incoming tensor into params[name] (names not in `params` or rejected by
    `keep` are skipped: an inference worker keeps only its shard)."""

    @torch.no_grad()
    def receive(name: str, tensor: torch.Tensor) -> None:
        dest = params.get(name)
        if dest is None or (keep is not None and not keep(name)):
            return
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: received shape {tuple(tensor.shape)}, the receiver has {tuple(dest.shape)}")
        dest.copy_(tensor)  # casts when the receiver keeps another dtype (e.g. bf16 inference weights)

    return receive


@torch.no_grad()
def sync_in_process(src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> BroadcastStats:
    """The single-process form of an update (colocated engines on one device): the same bucket packing and
    unpacking, with no process group. Returns timing stats."""
    metas = [TensorMeta(name, tuple(t.shape), t.dtype, 0) for name, t in src.items()]
    plan = plan_buckets(metas, bucket_bytes)
    device = next(iter(dst.values())).device if dst else torch.device("cpu")
    buffer = torch.empty(max((b.nbytes for b in plan), default=0), dtype=torch.uint8, device=device)
    receive = copy_into(dst)
    start = time.perf_counter()
    for bucket in plan:
        view = buffer[: bucket.nbytes]
        pack_bucket(bucket, src, view)
        for name, tensor in unpack_bucket(bucket, view):
            receive(name, tensor)
    total = sum(m.nbytes for m in metas)
    return BroadcastStats(len(metas), len(plan), total, time.perf_counter() - start)


# ---------------------------------------------------------------------- startup from disk
def safetensors_index(path: str | Path) -> dict[str, tuple[Path, tuple[int, ...], torch.dtype, int]]:
    """key -> (file, shape, dtype, nbytes) of every tensor of a safetensors checkpoint, read from the headers only."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path] if path.is_file() else []
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    index = {}
    for file in files:
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{file.name}: tensor {key} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            index[key] = (file, tuple(info["shape"]), _SAFETENSORS_DTYPES[info["dtype"]], end - begin)
    return index


def assign_readers(index: Mapping[str, tuple], world_size: int) -> dict[str, int]:
    """key -> the rank that reads it: largest tensors first, each to the rank with the fewest bytes so far."""
    loads = [0] * world_size
    owner = {}
    for key in sorted(index, key=lambda k: (-index[k][3], k)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[key] = rank
        loads[rank] += index[key][3]
    return owner


def load_and_broadcast(path: str | Path, engine: CheckpointEngine, receive: Receive) -> list[str]:
    """Startup: read this rank's disjoint share of the checkpoint at `path` and broadcast it, so every rank
    receives every tensor while the files are read once in total. Collective; returns the keys this rank read."""
    from safetensors import safe_open

    index = safetensors_index(path)
    owner = assign_readers(index, dist.get_world_size(engine.group))
    mine = sorted(k for k, r in owner.items() if r == engine.rank)
    local: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for key in mine:
        by_file.setdefault(index[key][0], []).append(key)
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for key in keys:
                local[key] = f.get_tensor(key)
    engine.broadcast(local, receive)
    return mine


__all__ = [
    "Bucket", "BroadcastStats", "CheckpointEngine", "TensorMeta", "assign_readers", "copy_into",
    "load_and_broadcast", "pack_bucket", "plan_buckets", "safetensors_index", "sync_in_process", "unpack_bucket",
]
