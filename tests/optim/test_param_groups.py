"""Tests for openk2.optim.param_groups: which parameters go to Muon and which to AdamW."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from openk2.optim.muon import Muon
from openk2.optim.param_groups import build_optimizers, default_muon_filter, param_groups

H, E, I, V = 16, 4, 8, 32
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


class ToyAttention(nn.Module):
    """MLA-style projections with HF DeepseekV3 names."""

    def __init__(self) -> None:
        super().__init__()
        self.q_a_proj = nn.Linear(H, 8, bias=False)
        self.q_a_layernorm = nn.RMSNorm(8)
        self.q_b_proj = nn.Linear(8, H, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, 6, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(4)
        self.kv_b_proj = nn.Linear(4, H, bias=False)
        self.o_proj = nn.Linear(H, H, bias=True)  # a bias, to check 1-D params go to AdamW


class ToyExperts(nn.Module):
    """Stacked routed experts as 3-D parameters without a .weight suffix."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(E, I, H))
        self.up_proj = nn.Parameter(torch.randn(E, I, H))
        self.down_proj = nn.Parameter(torch.randn(E, H, I))


class ToyMoE(nn.Module):
    """Router, routed experts and a shared expert."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = ToyExperts()
        self.shared_experts = ToyDenseMLP()


class ToyDenseMLP(nn.Module):
    """SwiGLU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)


class ToyLayer(nn.Module):
    """Decoder layer with either a dense MLP or an MoE."""

    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(H)
        self.self_attn = ToyAttention()
        self.post_attention_layernorm = nn.RMSNorm(H)
        self.mlp = ToyMoE() if moe else ToyDenseMLP()


class ToyInner(nn.Module):
    """The `model.` part of a causal LM."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.layers = nn.ModuleList([ToyLayer(moe=False), ToyLayer(moe=True)])
        self.norm = nn.RMSNorm(H)


class ToyLM(nn.Module):
    """A toy model whose parameter names follow HF DeepseekV3."""

    def __init__(self) -> None:
        super().__init__()
        self.model = ToyInner()
        self.lm_head = nn.Linear(H, V, bias=False)


EXPECTED_ADAMW = {
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
    *(f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in LAYER_NORMS),
    *(f"model.layers.{i}.self_attn.{n}.weight" for i in (0, 1) for n in ("q_a_layernorm", "kv_a_layernorm")),
    *(f"model.layers.{i}.self_attn.o_proj.bias" for i in (0, 1)),
}


def test_default_rule_splits_toy_model():
    """Hidden 2-D/3-D weights (attention, MLPs, experts, router) to Muon; embeddings, head, 1-D to AdamW."""
    model = ToyLM()
    muon, adamw = param_groups(model, lr=1e-3, weight_decay=0.1)
    assert muon["use_muon"] is True and adamw["use_muon"] is False
    assert set(adamw["param_names"]) == EXPECTED_ADAMW
    names = dict(model.named_parameters())
    assert set(muon["param_names"]) == set(names) - EXPECTED_ADAMW
    for group in (muon, adamw):
        assert group["lr"] == 1e-3 and group["weight_decay"] == 0.1
        assert all(p is names[n] for n, p in zip(group["param_names"], group["params"], strict=True))
    for n in (
        "model.layers.1.mlp.experts.gate_proj",
        "model.layers.1.mlp.experts.down_proj",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    ):
        assert n in muon["param_names"]


def test_custom_filter_and_frozen_params():
    """muon_filter overrides the rule; frozen parameters are left out of both groups."""
    model = ToyLM()
    model.model.layers[0].self_attn.q_a_proj.weight.requires_grad_(False)

    def only_experts(name: str, param: nn.Parameter) -> bool:
        return ".experts." in name

    muon, adamw = param_groups(model, lr=1.0, weight_decay=0.0, muon_filter=only_experts)
    assert sorted(muon["param_names"]) == [
        f"model.layers.1.mlp.experts.{n}" for n in ("down_proj", "gate_proj", "up_proj")
    ]
    assert "model.layers.0.self_attn.q_a_proj.weight" not in muon["param_names"] + adamw["param_names"]
    assert "model.layers.1.self_attn.o_proj.weight" in adamw["param_names"]


def test_default_filter_by_name_and_ndim():
    """The default rule uses only the name and the number of dimensions."""
    matrix, vector = nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(3))
    assert default_muon_filter("blocks.0.proj.weight", matrix)
    assert not default_muon_filter("blocks.0.proj.bias", vector)
    assert not default_muon_filter("tok_embeddings.weight", matrix)
    assert not default_muon_filter("lm_head.weight", matrix)


def test_tied_weights_counted_once():
    """A weight tied between embedding and head appears once, on the AdamW side."""
    model = ToyLM()
    model.lm_head.weight = model.model.embed_tokens.weight
    muon, adamw = param_groups(model, lr=1.0, weight_decay=0.0)
    ids = [id(p) for p in muon["params"] + adamw["params"]]
    assert len(ids) == len(set(ids))
    assert id(model.lm_head.weight) in {id(p) for p in adamw["params"]}


def test_build_optimizers_steps_every_param():
    """build_optimizers returns Muon + AdamW(0.9, 0.95) that together update every trainable parameter."""
    torch.manual_seed(0)
    model = ToyLM()
    muon, adamw = build_optimizers(model, lr=1e-2, weight_decay=0.1, ns_steps=4)
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    assert muon.param_groups[0]["ns_steps"] == 4
    assert adamw.param_groups[0]["betas"] == (0.9, 0.95) and adamw.param_groups[0]["eps"] == 1e-8
    for opt in (muon, adamw):
        assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.1
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    muon.step()
    adamw.step()
    for n, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[n]), n


def test_build_optimizers_rejects_empty_side():
    """A filter that leaves one optimizer with nothing raises ValueError."""
    with pytest.raises(ValueError, match="AdamW"):
        build_optimizers(ToyLM(), lr=1.0, weight_decay=0.0, muon_filter=lambda n, p: True)
