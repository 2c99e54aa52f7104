"""torch.distributed.checkpoint (DCP) with arbitrary local blocks: every rank writes and reads only its part.

A DCP state dict maps names to full-size logical tensors. A plain tensor is the whole tensor (replicated:
DCP writes it once, whichever rank holds it). A `Block` is one rank's rectangular part of a larger tensor at
given offsets, which covers what DTensor placements cannot: an expert slice [E/ep, ...] of [E, ...], and the
uneven flat ranges of ZeRO-1 (a range [a, b) of a parameter flattened to 1-D). DCP plans the reads on load
from the saved blocks' offsets, so a checkpoint written at one layout loads at any other (resharding).

The save/load planners are DCP's defaults with one extension: they resolve a `Block` to its local tensor.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

DCP_DIR = "dcp"  # the DCP shards inside a checkpoint directory


@dataclass
class Block:
    """`local` holds elements [offsets, offsets + local.shape) of a logical tensor of shape `size`."""

    local: torch.Tensor
    offsets: tuple[int, ...]
    global_size: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.offsets) == len(self.global_size) == self.local.ndim, (self.offsets, self.global_size)
        assert all(o + n <= g for o, n, g in zip(self.offsets, self.local.shape, self.global_size, strict=True))

    def size(self) -> torch.Size:
        return torch.Size(self.global_size)

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.local.shape)

    # DCP's checkpointable protocol (what DTensor implements): write items on save, chunks on load.
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(self.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._chunk(),
                                                      properties=TensorProperties.create_from_tensor(self.local),
                                                      size=self.size()))]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.local


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its elements: DCP torch.saves each item, which writes a view's whole storage."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor.cpu()
    whole = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole else tensor.clone()


class BlockSavePlanner(DefaultSavePlanner):
    """DCP's default save planner; resolves a Block to its local tensor and writes views compactly."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.local if isinstance(obj, Block) else super().lookup_object(index)

    def transform_object(self, write_item: WriteItem, object: Any):
        if isinstance(object, torch.Tensor):
            return _compact(object)
        return super().transform_object(write_item, object)


class BlockLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; resolves a Block to its local tensor (read into in place)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        # The default also materialises meta tensors, walking the dict in place and replacing every value of
        # a type it does not know (a Block) by None; nothing here is on the meta device.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.local if isinstance(obj, Block) else super().lookup_tensor(index)


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it assumes one process whenever torch.distributed is not initialised: that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_state(state: dict[str, Any], directory: Path, group: dist.ProcessGroup | None = None) -> None:
    """Write `state` (tensors, Blocks, picklable objects) as DCP shards into `directory`; collective."""
    with _quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)),
                 planner=BlockSavePlanner(), process_group=group, no_dist=_no_dist())


def staged_copy(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with every tensor copied to compact CPU memory, so training can go on while it is written."""
    def copy(value: Any) -> Any:
        if isinstance(value, Block):
            return Block(value.local.detach().to("cpu", copy=True), value.offsets, value.global_size)
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", copy=True)
        return value
    return {k: copy(v) for k, v in state.items()}


class _AlreadyStaged:
    """An AsyncStager for a state dict that `staged_copy` has already copied."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def async_save_state(state: dict[str, Any], directory: Path, group: dist.ProcessGroup | None = None) -> Future:
    """Copy `state` to CPU now and write it in a background thread; the future resolves when it is on disk.

    `group` must be a process group used by nothing else meanwhile (the writer thread runs its collectives)."""
    staged = staged_copy(state)
    if _no_dist():  # DCP's async path wants a process group; one process needs only a thread
        future: Future = Future()

        def write() -> None:
            try:
                save_state(staged, directory)
                future.set_result(None)
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(err)

        threading.Thread(target=write, name="openk2-checkpoint", daemon=True).start()
        return future
    return dcp.async_save(staged, storage_writer=dcp.FileSystemWriter(str(directory)),
                          planner=BlockSavePlanner(), process_group=group, async_stager=_AlreadyStaged())


def load_state(state: dict[str, Any], directory: Path, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Fill `state`'s tensors and Blocks in place from the DCP shards in `directory` (any saved layout);
    non-tensor entries are replaced by the saved objects. Returns `state`; collective."""
    with _quiet():
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)), planner=BlockLoadPlanner(),
                 process_group=group, no_dist=_no_dist())
    return state


def read_metadata(directory: Path) -> Metadata:
    """The DCP metadata of `directory`: every saved name with its global size, dtype and saved blocks."""
    return dcp.FileSystemReader(str(directory)).read_metadata()


def tensor_shapes(metadata: Metadata, prefix: str = "") -> dict[str, TensorStorageMetadata]:
    """The saved tensors whose names start with `prefix` (name -> size, dtype, blocks), in saved order."""
    return {k: v for k, v in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}


class _Reader(dcp.FileSystemReader):
    """FileSystemReader that reads `.metadata` once, for many small loads from one checkpoint."""

    def __init__(self, directory: Path, metadata: Metadata | None = None) -> None:
        super().__init__(str(directory))
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def read_local(directory: Path, state: dict[str, Any], metadata: Metadata | None = None) -> dict[str, Any]:
    """Fill `state` (tensors or Blocks: whole tensors or any rectangle of them) from `directory`, in this
    process alone (no collectives), reading only the saved blocks that overlap what is asked for."""
    with _quiet():
        dcp.load(state, storage_reader=_Reader(directory, metadata), planner=BlockLoadPlanner(), no_dist=True)
    return state


def read_tensors(directory: Path, shapes: dict[str, TensorStorageMetadata],
                 metadata: Metadata | None = None) -> dict[str, torch.Tensor]:
    """Read whole tensors `shapes` (from `tensor_shapes`) into fresh CPU memory, in this process alone."""
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in shapes.items()}
    return read_local(directory, state, metadata)
