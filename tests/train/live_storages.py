"""A tensor-storage recorder for memory tests: which storages the ops run inside it allocated, and how many of
their bytes are still alive (what CUDA's memory_allocated would count), on any device."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class NewStorages(TorchDispatchMode):
    """Records the storage of every tensor an op returns while active (weakly), except the storages in `skip`."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip = skip
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}  # address -> (storage last allocated there, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                address, seen = storage.data_ptr(), self.storages.get(storage.data_ptr())
                if address and address not in self.skip and (seen is None or seen[0].expired()):
                    self.storages[address] = (StorageWeakRef(storage), storage.nbytes())
        return result

    def alive_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.storages.values() if not ref.expired())
