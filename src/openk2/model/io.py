"""HF-layout safetensors checkpoints: per-expert keys on disk, stacked 3-D experts in memory, block-FP8 dequant.

On disk (as Kimi-K2 / DeepSeek-V3 release them): `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`,
optionally FP8 (`float8_e4m3fn` weight + `weight_scale_inv`, one fp32 scale per 128x128 block).
In memory: `model.layers.{i}.mlp.experts.{gate,up,down}_proj` of shape [E, out, in].
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from openk2.config import ModelConfig
from openk2.model.rope import rope_inv_freq

_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# transformers 5.x keeps experts fused in memory: gate_up_proj [E, 2I, D] and down_proj [E, D, I].
_FUSED_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
_IGNORED = ("rotary_emb.inv_freq",)
FP8_BLOCK = 128  # DeepSeek-V3 / K2 quantise weights in 128x128 blocks


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Block-FP8 to fp32: each [block x block] tile times its scale (edge tiles may be partial)."""
    rows, cols = weight.shape
    expected = (math.ceil(rows / block), math.ceil(cols / block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for a "
                         f"{rows}x{cols} weight in {block}x{block} blocks")
    scale = scale_inv.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return weight.float() * scale


# ------------------------------------------------------------------------------------------ saving
def hf_state_dict(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF key, tensor) pairs: stacked experts split into per-expert weights, tied lm_head dropped."""
    tied = model.config.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        if name.endswith((".experts.gate_proj", ".experts.up_proj", ".experts.down_proj")):
            prefix, proj = name.rsplit(".", 1)
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.{proj}.weight", tensor[e]
        else:
            yield name, tensor


def save_pretrained(model: torch.nn.Module, path: str | Path, max_shard_bytes: int = 2 << 30) -> None:
    """Write `config.json` and safetensors shards (+ index when more than one)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    items = list(hf_state_dict(model))
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for key, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, tensor))
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: t.detach().contiguous().cpu() for k, t in shard}, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k, _ in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for _, t in items)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf = model.config.to_hf()
    hf["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


# ------------------------------------------------------------------------------------------ loading
def _shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise ValueError(f"{path}: shard(s) named in the index are missing: {', '.join(missing)}")
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ValueError(f"no safetensors checkpoint in {path}")
    return found


class _Loader:
    """Copies checkpoint tensors into `targets` (in-memory names -> tensors), reading only the tensors they need.

    A stacked expert target [E_local, ...] named in `expert_offsets` holds global experts [offset, offset +
    E_local) (one expert-parallel rank's share); the other experts' tensors are never read."""

    def __init__(self, config: ModelConfig, targets: dict[str, torch.Tensor],
                 expert_offsets: dict[str, int] | None = None) -> None:
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.targets = targets
        self.offsets = expert_offsets or {}
        self.pending = set(self._expected_keys())
        self.other_keys: frozenset[str] = frozenset()  # checkpoint keys other ranks own: skipped unread
        self.skipped_mtp = 0
        self.bytes_read = 0

    def _expected_keys(self) -> Iterator[str]:
        for name, tensor in self.targets.items():
            if name.endswith(_IGNORED) or (self.config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if name.endswith((".experts.gate_proj", ".experts.up_proj", ".experts.down_proj")):
                prefix, proj = name.rsplit(".", 1)
                first = self.offsets.get(name, 0)
                yield from (f"{prefix}.{e}.{proj}.weight" for e in range(first, first + tensor.shape[0]))
            else:
                yield name

    def _wanted(self, key: str) -> bool:
        """Whether to read `key`; keys of other ranks are skipped, keys of no rank fail in assign."""
        if (m := _FUSED_KEY.match(key)) is not None:  # one tensor for all experts: read if any is held here
            held = f"{m.group(1)}.down_proj" in self.targets
            return held or f"{m.group(1)}.0.down_proj.weight" not in self.other_keys
        return key not in self.other_keys

    def load_file(self, file: Path) -> None:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
            for key in keys:
                if key.endswith("weight_scale_inv") or key.endswith(_IGNORED):
                    continue
                layer = _LAYER_KEY.match(key)
                if layer and int(layer.group(1)) >= self.num_layers:
                    self.skipped_mtp += 1  # MTP layers sit after the main stack; K2 has none
                    continue
                if not self._wanted(key):  # another rank's tensor: not read
                    continue
                tensor = f.get_tensor(key)
                self.bytes_read += tensor.nbytes
                scale_key = key.removesuffix("weight") + "weight_scale_inv"
                if tensor.dtype == torch.float8_e4m3fn:
                    if scale_key not in keys:
                        raise ValueError(f"{file.name}: FP8 tensor {key} has no {scale_key}")
                    tensor = dequantize_fp8_blocks(tensor, f.get_tensor(scale_key))
                self.assign(key, tensor)

    def assign(self, key: str, tensor: torch.Tensor) -> None:
        if (m := _EXPERT_KEY.match(key)) is not None:
            prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
            self._copy(f"{prefix}.{proj}", tensor, key, index=e)
        elif (m := _FUSED_KEY.match(key)) is not None:
            prefix, which = m.group(1), m.group(2)
            if which == "down_proj":
                for e in range(tensor.shape[0]):
                    self._copy(f"{prefix}.down_proj", tensor[e], f"{prefix}.{e}.down_proj.weight", e, fused=True)
            else:
                gate, up = tensor.chunk(2, dim=1)
                for e in range(tensor.shape[0]):
                    self._copy(f"{prefix}.gate_proj", gate[e], f"{prefix}.{e}.gate_proj.weight", e, fused=True)
                    self._copy(f"{prefix}.up_proj", up[e], f"{prefix}.{e}.up_proj.weight", e, fused=True)
        elif key in self.targets:
            self._copy(key, tensor, key)
        elif key == "lm_head.weight" and self.config.tie_word_embeddings:
            return
        else:
            raise ValueError(f"unexpected tensor {key!r} in checkpoint (not part of this config's model)")

    @torch.no_grad()
    def _copy(self, target: str, tensor: torch.Tensor, hf_key: str, index: int | None = None,
              fused: bool = False) -> None:
        if target not in self.targets:
            raise ValueError(f"unexpected tensor {hf_key!r} in checkpoint (not part of this config's model)")
        dest = self.targets[target]
        if index is not None:
            local = index - self.offsets.get(target, 0)
            if fused and not 0 <= local < dest.shape[0]:
                return  # another expert-parallel rank's expert: a fused tensor holds every expert
            if not 0 <= local < dest.shape[0]:
                raise ValueError(f"unexpected tensor {hf_key!r} in checkpoint (expert {index} is not held here)")
            dest = dest[local]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch for {hf_key}: expected {tuple(dest.shape)}, found {tuple(tensor.shape)}")
        dest.copy_(tensor)
        self.pending.discard(hf_key)


def load_into(targets: dict[str, torch.Tensor], config: ModelConfig, path: str | Path,
              expert_offsets: dict[str, int] | None = None, all_keys: frozenset[str] = frozenset()) -> int:
    """Fill `targets` (full-model names -> tensors, e.g. one rank's share) from the HF checkpoint at `path`,
    reading only the tensors they need; `all_keys` are the whole model's checkpoint keys (those not needed here
    are skipped unread). Returns the bytes read. Missing tensors, and keys of no rank, are a ValueError."""
    path = Path(path)
    loader = _Loader(config, targets, expert_offsets)
    loader.other_keys = frozenset(all_keys - loader.pending)
    for file in _shard_files(path):
        loader.load_file(file)
    _check_complete(loader, path)
    return loader.bytes_read


def _check_complete(loader: _Loader, path: Path) -> None:
    if loader.pending:
        missing = sorted(loader.pending)
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {path} is missing tensors: {', '.join(missing[:5])}{more}")


def load_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None, device="cpu"):
    """Build `cls(config)` without initialising weights, then stream the checkpoint into it shard by shard."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint directory {path} does not exist")
    cfg = ModelConfig.from_hf(path)
    dtype = dtype or getattr(torch, cfg.dtype, torch.float32)
    with torch.device("meta"):
        model = cls(cfg)
    model.to_empty(device=device)
    model.to(dtype)
    _reset_runtime_buffers(model)
    targets = dict(model.named_parameters())
    targets.update(model.named_buffers())
    loader = _Loader(cfg, targets)
    for file in _shard_files(path):
        loader.load_file(file)
    _check_complete(loader, path)
    if loader.skipped_mtp:
        print(f"note: skipped {loader.skipped_mtp} MTP-layer tensors (not part of K2)", file=sys.stderr)
    return model


@torch.no_grad()
def _reset_runtime_buffers(model: torch.nn.Module) -> None:
    # Buffers that are not in checkpoints are recomputed; the router bias stays fp32 whatever the weights'
    # dtype, because bf16 cannot hold the small differences that decide expert selection.
    model.model.rotary_emb.inv_freq = rope_inv_freq(model.config)[0].to(model.model.rotary_emb.inv_freq.device)
    for moe in model.moe_layers():
        moe.gate.e_score_correction_bias = moe.gate.e_score_correction_bias.float()
