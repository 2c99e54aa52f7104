"""HF-layout safetensors streamed out of a checkpoint's DCP shards, one tensor (or expert batch) at a time.

The safetensors format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
range) and the raw bytes. Every shape and dtype is in the DCP metadata, so each file's header is written
first and the tensors are then read from the shards and appended in order: memory holds one tensor (an
expert stack is read `budget` bytes of experts at a time), never the model. Stacked experts [E, out, in]
become the per-expert HF names `...experts.{e}.{proj}.weight`, as `model.save_pretrained` writes them.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from openk2.config import ModelConfig
from openk2.train.dcp import DCP_DIR, Block, read_local, read_metadata, read_tensors, tensor_shapes
from openk2.train.dcp_state import MODEL

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
           torch.int32: "I32", torch.bool: "BOOL"}
_EXPERT_SUFFIXES = (".experts.gate_proj", ".experts.up_proj", ".experts.down_proj")
_COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "tiktoken.model", "special_tokens_map.json")


@dataclass
class _Source:
    """One saved model tensor and the HF tensors it becomes (one, or one per expert)."""

    name: str
    meta: TensorStorageMetadata
    hf_names: list[str]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.meta.size)

    def hf_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if len(self.hf_names) > 1 or self.name.endswith(_EXPERT_SUFFIXES) else self.shape


def _sources(metadata: Metadata, tied: bool) -> list[_Source]:
    out = []
    for key, meta in tensor_shapes(metadata, MODEL).items():
        name = key.removeprefix(MODEL)
        if tied and name == "lm_head.weight":
            continue
        if name.endswith(_EXPERT_SUFFIXES):
            prefix, proj = name.rsplit(".", 1)
            out.append(_Source(name, meta, [f"{prefix}.{e}.{proj}.weight" for e in range(meta.size[0])]))
        else:
            out.append(_Source(name, meta, [name]))
    return out


def _header(sources: list[_Source], dtype: torch.dtype) -> bytes:
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for src in sources:
        shape = src.hf_shape()
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        for hf in src.hf_names:
            entries[hf] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned


def _write_source(f, directory: Path, metadata: Metadata, src: _Source, dtype: torch.dtype, budget: int) -> None:
    if not src.shape:
        part = read_tensors(directory, {MODEL + src.name: src.meta}, metadata)[MODEL + src.name]
        f.write(part.to(dtype).reshape(1).view(torch.uint8).numpy().tobytes())
        return
    per_row = max(1, int(torch.Size(src.shape[1:]).numel()) * src.meta.properties.dtype.itemsize)
    step = max(1, budget // per_row)  # rows (experts, for a stack) per read
    for first in range(0, src.shape[0], step):
        n = min(step, src.shape[0] - first)
        block = Block(torch.empty((n, *src.shape[1:]), dtype=src.meta.properties.dtype),
                      (first,) + (0,) * (len(src.shape) - 1), src.shape)
        read_local(directory, {MODEL + src.name: block}, metadata)
        f.write(block.local.to(dtype).contiguous().view(torch.uint8).numpy().tobytes())


def export_hf(checkpoint: str | Path, out: str | Path, dtype: torch.dtype = torch.float32,
              max_shard_bytes: int = 2 << 30, budget: int = 256 << 20) -> list[Path]:
    """Write checkpoint `checkpoint`'s model (from dcp/) as HF safetensors + config.json + tokenizer into
    `out`, streaming; returns the safetensors files written."""
    checkpoint, out = Path(checkpoint), Path(out)
    if not (checkpoint / DCP_DIR).is_dir():
        raise ValueError(f"{checkpoint} has no {DCP_DIR}/ shards (not an openk2 training checkpoint)")
    if dtype not in _DTYPES:
        raise ValueError(f"cannot export as {dtype}; choose float32, bfloat16 or float16")
    config = ModelConfig.from_hf(checkpoint)
    metadata = read_metadata(checkpoint / DCP_DIR)
    sources = _sources(metadata, config.tie_word_embeddings)
    files: list[list[_Source]] = [[]]
    size = 0
    for src in sources:
        nbytes = int(torch.Size(src.shape).numel()) * dtype.itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(src)
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    written, weight_map = [], {}
    for i, group in enumerate(files):
        name = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        header = _header(group, dtype)
        with (out / name).open("wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for src in group:
                _write_source(f, checkpoint / DCP_DIR, metadata, src, dtype, budget)
        weight_map.update({hf: name for src in group for hf in src.hf_names})
        written.append(out / name)
    if len(files) > 1:
        total = sum(int(torch.Size(s.shape).numel()) * dtype.itemsize for s in sources)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for extra in _COPIED:
        if (checkpoint / extra).is_file() and checkpoint.resolve() != out.resolve():
            shutil.copyfile(checkpoint / extra, out / extra)
    hf = json.loads((out / "config.json").read_text()) if (out / "config.json").is_file() else config.to_hf()
    (out / "config.json").write_text(json.dumps({**hf, "torch_dtype": str(dtype).removeprefix("torch.")}, indent=2))
    return written


def read_model_state(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint (native names, full shapes) read from its dcp/ shards, in one process."""
    directory = Path(checkpoint) / DCP_DIR
    shapes = tensor_shapes(read_metadata(directory), MODEL)
    return {k.removeprefix(MODEL): v for k, v in read_tensors(directory, shapes).items()}
