"""The training state under layout-free names, as DCP entries: what a checkpoint holds whatever wrote it.

Names (every tensor at its full, single-process shape):
  model/<name>              the model's state dict (parameters and the router-bias buffers), native names
  optim/momentum/<name>     Muon momentum, flattened to 1-D
  optim/exp_avg/<name>      AdamW first moment, flattened
  optim/exp_avg_sq/<name>   AdamW second moment, flattened
  optim/step/<name>         AdamW step count (0-d)
  optim/master/<name>       fp32 master weights, flattened (only under parallel.param_dtype = "bfloat16")

One process holds whole tensors; a parallel rank holds Blocks: its expert rows (`row_shards`: name ->
(first row, full rows)) and, for the distributed optimizer, the momentum of the Muon matrices (or expert rows)
it owns and the flat DTensor shard of each AdamW parameter's moments. Optimizer state is flattened so that
every one of these pieces is a rectangle (a range) of one 1-D tensor. Saving reads views of the live state;
loading fills fresh buffers (MuonClip) or the live ones in place (DistributedMuonClip), then `install()`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from openk2.optim.muonclip import MuonClip
from openk2.train.dcp import Block
from openk2.train.parallel.zero import DistributedMuonClip

RowShards = dict[str, tuple[int, int]]  # name -> (first row this rank holds, rows of the full tensor)
Entries = dict[str, torch.Tensor | Block]
MODEL, MOMENTUM, EXP_AVG, EXP_AVG_SQ, STEP = "model/", "optim/momentum/", "optim/exp_avg/", "optim/exp_avg_sq/", \
    "optim/step/"
MASTER = "optim/master/"


def model_entries(tensors: dict[str, torch.Tensor], row_shards: RowShards | None = None) -> Entries:
    """`model/<name>` entries for this rank's tensors (full names); expert rows become Blocks."""
    out: Entries = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        if row_shards and name in row_shards:
            first, rows = row_shards[name]
            out[MODEL + name] = Block(tensor, (first,) + (0,) * (tensor.ndim - 1), (rows, *tensor.shape[1:]))
        else:
            out[MODEL + name] = tensor
    return out


def _flat_extent(name: str, p: torch.Tensor, row_shards: RowShards | None) -> tuple[int, int]:
    """(offset of this rank's copy of `p` in the full flattened tensor, full flattened size)."""
    if row_shards and name in row_shards:
        first, rows = row_shards[name]
        per_row = p.numel() // p.shape[0]
        return first * per_row, rows * per_row
    return 0, p.numel()


def _whole(name: str, flat: torch.Tensor, p: torch.Tensor, row_shards: RowShards | None) -> torch.Tensor | Block:
    offset, size = _flat_extent(name, p, row_shards)
    return flat if (offset, size) == (0, flat.numel()) else Block(flat, (offset,), (size,))


def optimizer_entries(optimizer: MuonClip | DistributedMuonClip, named_params: list[tuple[str, nn.Parameter]],
                      row_shards: RowShards | None = None, fresh: bool = False) -> tuple[Entries, Callable[[], None]]:
    """The optimizer's `optim/...` entries and an `install()` that puts loaded values in (a no-op for saving).

    fresh=False: views of the live state, for saving. fresh=True: buffers to load into, then call install()."""
    if isinstance(optimizer, DistributedMuonClip):
        return _zero_entries(optimizer, named_params, row_shards, fresh)
    return _muonclip_entries(optimizer, named_params, row_shards, fresh)


def _adamw_install(adamw: torch.optim.Optimizer, states: dict[nn.Parameter, dict]) -> Callable[[], None]:
    def install() -> None:
        index = {id(p): i for i, p in enumerate(p for g in adamw.param_groups for p in g["params"])}
        saved = adamw.state_dict()
        saved["state"] = {index[id(p)]: st for p, st in states.items()}
        adamw.load_state_dict(saved)  # casts to the parameters' device; keeps the step count's own dtype
    return install


def _step_tensor(state: dict) -> torch.Tensor:
    step = state.get("step", 0.0)
    return (step.detach().clone() if torch.is_tensor(step) else torch.tensor(float(step))).float().cpu()


def _muonclip_entries(opt: MuonClip, named_params, row_shards, fresh: bool):
    muon_ids = {id(p) for g in opt.muon.param_groups for p in g["params"]} if opt.muon is not None else set()
    entries: Entries = {}
    muon_fresh: dict[nn.Parameter, torch.Tensor] = {}
    adam_fresh: dict[nn.Parameter, dict] = {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        if id(p) in muon_ids:
            live = opt.muon.state.get(p, {}).get("momentum_buffer")
            flat = torch.zeros(p.numel()) if fresh or live is None else live.detach().reshape(-1)
            muon_fresh[p] = flat
            entries[MOMENTUM + name] = _whole(name, flat, p, row_shards)
            continue
        live = opt.adamw.state.get(p, {})
        moments = {}
        for key, prefix in (("exp_avg", EXP_AVG), ("exp_avg_sq", EXP_AVG_SQ)):
            moments[key] = torch.zeros(p.numel()) if fresh or key not in live else live[key].detach().reshape(-1)
            entries[prefix + name] = _whole(name, moments[key], p, row_shards)
        entries[STEP + name] = torch.zeros(()) if fresh else _step_tensor(live)
        adam_fresh[p] = {"step": entries[STEP + name], **moments}

    def install() -> None:
        for p, flat in muon_fresh.items():
            opt.muon.state[p]["momentum_buffer"] = flat.view(p.shape).to(device=p.device, dtype=torch.float32)
        for p, st in adam_fresh.items():
            st["exp_avg"], st["exp_avg_sq"] = (st[k].view(p.shape) for k in ("exp_avg", "exp_avg_sq"))
        _adamw_install(opt.adamw, adam_fresh)()
    return entries, (install if fresh else lambda: None)


def _zero_entries(opt: DistributedMuonClip, named_params, row_shards, fresh: bool):
    """Views of the live sharded state (loaded in place, so install() has nothing to do): each owned Muon unit's
    momentum, each AdamW shard's moments as 1-D Blocks of the flattened full parameter; `fresh` changes nothing."""
    entries: Entries = {}
    for where, muon in opt.muon.items():
        names = opt.names[where]["muon"]
        for unit, buffer in muon.buffers.items():
            name, p = names[unit.index], muon.params[unit.index]
            offset, size = _flat_extent(name, p, row_shards)
            first = unit.start * (p.numel() // p.shape[0]) if unit.is_rows else 0
            pieces = [(MOMENTUM, buffer)] + ([(MASTER, muon.masters[unit])] if muon.masters else [])
            for prefix, tensor in pieces:
                flat = tensor.view(-1)
                entries[prefix + name] = (flat if (offset + first, flat.numel()) == (0, size)
                                          else Block(flat, (offset + first,), (size,)))
        adamw = opt.adamw[where]
        for name, p, m, (start, stop) in zip(opt.names[where]["adamw"], adamw.params, adamw.masters, adamw.ranges,
                                             strict=True):
            state = adamw.adamw.state[m]
            offset, size = _flat_extent(name, p, row_shards)
            if stop > start:
                pieces = [(state["exp_avg"], EXP_AVG), (state["exp_avg_sq"], EXP_AVG_SQ)]
                for tensor, prefix in pieces + ([(m, MASTER)] if adamw.master else []):
                    local = adamw.local(tensor)
                    entries[prefix + name] = (local if (offset + start, local.numel()) == (0, size)
                                              else Block(local, (offset + start,), (size,)))
            entries[STEP + name] = state["step"]
    return entries, lambda: None
