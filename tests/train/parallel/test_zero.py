"""ZeRO-1 MuonClip: sharded distributed Muon + AdamW equals single-process MuonClip on the same gradients."""

from __future__ import annotations

import math

import pytest
import torch

from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM
from openk2.optim.muonclip import MuonClip
from openk2.train.parallel.zero import ZeroMuonClip, shard_pieces
from tests.train.conftest import MICRO_MODEL
from tests.train.parallel.ranks import run_ranks

STEPS = 3
HYPER = {"lr": 0.02, "weight_decay": 0.1, "tau": None, "ns_dtype": torch.float32}


def _model() -> K2ForCausalLM:
    torch.manual_seed(0)
    fields = {k: v for k, v in MICRO_MODEL.items() if k != "preset"}
    return K2ForCausalLM(ModelConfig.preset("tiny").replace(**fields))


def _gradients(model: K2ForCausalLM, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) * 0.01 for p in model.parameters()]


def _zero(model: K2ForCausalLM) -> ZeroMuonClip:
    return ZeroMuonClip(model, list(model.named_parameters()), dict(enumerate(model.attention_layers())), **HYPER)


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    opt = MuonClip(model, **HYPER)
    for step in range(STEPS):
        for p, g in zip(model.parameters(), _gradients(model, step), strict=True):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_sharded(rank: int) -> dict:
    model = _model()
    opt = _zero(model)
    share = 0.25 if rank == 0 else 0.75  # unequal halves: only their sum is the gradient
    for step in range(STEPS):
        for p, g in zip(model.parameters(), _gradients(model, step), strict=True):
            p.grad = g * share
        opt.reduce_gradients()
        opt.step()
    sizes = {name: buf.numel() for name, buf in opt.momentum_buffers.items()}
    numels = {b.name: b.shard.numel for b in opt.buckets}
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "sizes": sizes,
            "numels": numels}


def test_one_process_zero_equals_muonclip():
    model = _model()
    opt = _zero(model)
    for step in range(STEPS):
        for p, g in zip(model.parameters(), _gradients(model, step), strict=True):
            p.grad = g.clone()
        opt.reduce_gradients()
        opt.step()
    expected = _reference()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_two_rank_distributed_muon_equals_single_process():
    results = run_ranks(2, _train_sharded)
    expected = _reference()
    for rank in (0, 1):
        for name, value in results[rank]["params"].items():
            # fp32 throughout; the ranks' halves are summed by reduce-scatter, so ~1 ulp of gradient differs.
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=f"rank {rank}: {name}")
        for bucket, size in results[rank]["sizes"].items():  # each rank holds half of the momentum
            assert size == math.ceil(results[rank]["numels"][bucket] / 2)


def test_shard_pieces_cover_every_element_exactly_once():
    numels = [12, 5, 8]  # 25 elements over 3 ranks: slices of 9, 9 and 7 (+2 padding)
    covered = []
    for rank in range(3):
        for piece in shard_pieces(numels, 3, rank):
            assert 0 <= piece.shard_offset and piece.shard_offset + piece.stop - piece.start <= 9
            covered += [(piece.index, e) for e in range(piece.start, piece.stop)]
    assert sorted(covered) == [(i, e) for i, n in enumerate(numels) for e in range(n)]


def test_loading_a_shard_of_another_layout_is_a_value_error():
    opt = _zero(_model())
    state = opt.state_dict()
    state["layout"]["dense/muon"]["group_size"] = 2
    with pytest.raises(ValueError, match="different parallel layout"):
        opt.load_state_dict(state)
