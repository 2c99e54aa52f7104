"""Reading a checkpoint back: the run state (rank 0's JSON), the DCP training state (any saved layout) and
each rank's own file, with one-line errors for checkpoints this run cannot continue."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from openk2.train.dcp import DCP_DIR, load_state, read_metadata
from openk2.train.dcp_checkpoint import rank_file
from openk2.train.dcp_state import Entries

STATE_FILE = "trainer_state.json"
FORMAT = "openk2-dcp-1"  # trainer_state.json's "format": model and optimizer in dcp/, layout-free names


def fmt_layout(layout: dict[str, int]) -> str:
    return " x ".join(f"{axis}{layout.get(axis, 1)}" for axis in ("pp", "dp", "ep"))


def write_run_state(path: Path, state: dict[str, Any]) -> None:
    """Write the run state (step, loader and schedule position, layout) as `path/trainer_state.json`."""
    (path / STATE_FILE).write_text(json.dumps({"format": FORMAT, **state}))


def read_run_state(path: Path) -> dict[str, Any]:
    """The run state of checkpoint `path`; ValueError when it is not a checkpoint this version resumes."""
    state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    if state.get("format") != FORMAT or not (path / DCP_DIR).is_dir():
        raise ValueError(f"checkpoint {path} was written by an older openk2 (no {DCP_DIR}/ shards); its model "
                         "still loads (sft.init_from, local:), but its optimizer state cannot be resumed")
    return state


def _all_keys(keys: set[str], group: dist.ProcessGroup | None) -> set[str]:
    if not (dist.is_available() and dist.is_initialized()):
        return keys
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, sorted(keys), group=group)
    return {k for part in parts for k in part}


def load_training_state(path: Path, entries: Entries, group: dist.ProcessGroup | None = None) -> None:
    """Fill `entries` (this rank's part, in this run's layout) from `path/dcp`; collective. ValueError when
    the checkpoint holds other tensors than this run's model and optimizer, or other shapes."""
    metadata = read_metadata(path / DCP_DIR)
    saved = set(metadata.state_dict_metadata)
    wanted = _all_keys(set(entries), group)
    missing, extra = sorted(wanted - saved), sorted(saved - wanted)
    if missing or extra:
        what = f"it has no {missing[0]}" if missing else f"it has {extra[0]}, which this run does not"
        count = len(missing) + len(extra)
        raise ValueError(f"checkpoint {path} was saved with a different optimizer or model ({what}; {count} "
                         "names differ): resume with the same model and optim settings")
    for name, value in entries.items():
        saved_size = tuple(metadata.state_dict_metadata[name].size)
        if tuple(value.size()) != saved_size:
            raise ValueError(f"checkpoint {path}: {name} has shape {saved_size}, this run's model expects "
                             f"{tuple(value.size())}")
    try:
        load_state(entries, path / DCP_DIR, group)
    except CheckpointException as err:
        raise ValueError(f"checkpoint {path} could not be read: {err}") from None


def load_rank_state(path: Path, rank: int) -> dict[str, Any]:
    """This rank's file of checkpoint `path`, or rank 0's when the checkpoint had fewer ranks."""
    own = rank_file(path, rank)
    return torch.load(own if own.is_file() else rank_file(path, 0), weights_only=False)
