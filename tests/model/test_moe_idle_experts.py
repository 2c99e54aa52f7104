"""The idle-expert skip (RoutedExperts.active_swiglu): the same outputs and gradients as the grouped matmul over
all experts, and the path a small CPU batch takes."""

import pytest
import torch

import openk2.model.moe as moe_module
from openk2.model.moe import MoE

from .conftest import small_config


def _moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    cfg = small_config(n_routed_experts=16, num_experts_per_tok=2)
    moe = MoE(cfg, cfg.first_k_dense_replace)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def _run(moe: MoE, x: torch.Tensor, skip: bool):
    moe.zero_grad()
    x = x.clone().requires_grad_(True)
    routing = moe.gate(x)
    counts = torch.bincount(routing.indices_NK.reshape(-1), minlength=moe.experts.gate_proj.shape[0])
    old = moe_module.IDLE_SKIP_ROWS
    moe_module.IDLE_SKIP_ROWS = 10**9 if skip else 0
    try:
        y, _ = moe.experts(x, routing)
    finally:
        moe_module.IDLE_SKIP_ROWS = old
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    grads = [p.grad.clone() for p in moe.experts.parameters()] + [moe.gate.weight.grad.clone(), x.grad.clone()]
    return y.detach(), grads, counts


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_active_experts_match_the_grouped_matmul_in_values_and_gradients(tokens):
    moe = _moe()
    x = torch.randn(tokens, moe.experts.gate_proj.shape[2], generator=torch.Generator().manual_seed(tokens))
    y_skip, g_skip, counts = _run(moe, x, skip=True)
    y_full, g_full, _ = _run(moe, x, skip=False)
    if tokens < 8:
        assert (counts == 0).any()  # the case the skip exists for
    torch.testing.assert_close(y_skip, y_full, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_skip, g_full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    idle = counts == 0
    for g in g_skip[:3]:  # an idle expert's weights get exactly zero gradient
        assert bool((g[idle] == 0).all())


def test_small_cpu_batches_take_the_active_path(monkeypatch):
    moe = _moe()
    calls = []
    real = moe.experts.active_swiglu
    monkeypatch.setattr(moe.experts, "active_swiglu", lambda *a: calls.append(1) or real(*a))
    d = moe.experts.gate_proj.shape[2]
    with torch.no_grad():
        moe(torch.randn(1, 2, d))  # 4 (token, expert) rows for 16 experts
        assert calls == [1]
        moe(torch.randn(4, 64, d))  # 512 rows: every expert busy, the plain grouped matmul
        assert calls == [1]
