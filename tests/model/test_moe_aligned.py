"""Aligned expert rows (bf16 on CPU): each expert's group padded with zero rows to a multiple of CPU_ALIGN_ROWS,
the same outputs and gradients as the unpadded grouped matmul."""

import pytest
import torch
import torch._dynamo.testing

import openk2.model.moe as moe_module
from openk2.model.moe import MoE, aligned_rows

from .conftest import small_config


def test_aligned_rows_layout():
    experts_M = torch.tensor([0, 0, 0, 2, 3, 3, 3, 3, 3])  # expert 1 idle
    token_of_row = torch.tensor([5, 1, 7, 0, 2, 3, 4, 6, 8])
    counts_E = torch.bincount(experts_M, minlength=4)
    rows_P, dest_M, ends_E = aligned_rows(experts_M, token_of_row, counts_E, pad_token=9, align=4)
    assert ends_E.tolist() == [4, 4, 8, 16] and ends_E.dtype == torch.int32
    assert rows_P.tolist() == [5, 1, 7, 9, 0, 9, 9, 9, 2, 3, 4, 6, 8, 9, 9, 9]
    assert torch.equal(rows_P[dest_M], token_of_row)


def test_static_aligned_rows_layout_depends_on_no_routing():
    # Compiled blocks: P is the bound M + E*(align-1) rounded down to align (9 + 4*3 = 21 -> 20) for every
    # routing; the last group takes the slack as padding, so the real rows sit where the exact layout puts them.
    token_of_row = torch.tensor([5, 1, 7, 0, 2, 3, 4, 6, 8])
    for experts in ([0, 0, 0, 2, 3, 3, 3, 3, 3], [0, 1, 1, 1, 1, 1, 2, 2, 3], [3] * 9):
        experts_M = torch.tensor(experts)
        counts_E = torch.bincount(experts_M, minlength=4)
        rows_P, dest_M, ends_E = aligned_rows(experts_M, token_of_row, counts_E, pad_token=9, align=4, static=True)
        exact_rows, exact_dest, exact_ends = aligned_rows(experts_M, token_of_row, counts_E, pad_token=9, align=4)
        assert rows_P.shape == (20,) and ends_E[-1] == 20 and ends_E.dtype == torch.int32
        assert torch.equal(ends_E[:-1], exact_ends[:-1]) and torch.equal(dest_M, exact_dest)
        assert torch.equal(rows_P[: exact_rows.numel()], exact_rows) and (rows_P[exact_rows.numel():] == 9).all()


def _moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    cfg = small_config(n_routed_experts=8, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=32)
    moe = MoE(cfg, cfg.first_k_dense_replace)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def _run(moe: MoE, x: torch.Tensor, aligned: bool, monkeypatch):
    monkeypatch.setattr(moe_module, "aligns_rows", lambda *a: aligned)
    moe.zero_grad()
    x = x.clone().requires_grad_(True)
    routing = moe.gate(x)
    y, counts = moe.experts(x, routing)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y.detach(), counts] + [p.grad.clone() for p in moe.experts.parameters()] + [moe.gate.weight.grad, x.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aligned_rows_give_the_unpadded_values_and_gradients(dtype, monkeypatch):
    moe = _moe().to(dtype)
    x = torch.randn(45, 64, generator=torch.Generator().manual_seed(1)).to(dtype)  # 90 rows: no group a multiple
    padded = _run(moe, x, True, monkeypatch)
    plain = _run(moe, x, False, monkeypatch)
    # Padding rows are zeros with zero weight: real rows see the same products. fp32 allows BLAS's blocking
    # to differ with the row count; bf16 one rounding of a sum of differently blocked fp32 partials.
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for a, b in zip(padded, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_bf16_on_cpu_takes_the_aligned_path(monkeypatch):
    moe = _moe().to(torch.bfloat16)
    calls = []
    real = moe.experts._aligned_forward
    monkeypatch.setattr(moe.experts, "_aligned_forward", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        moe(torch.randn(2, 32, 64).bfloat16())  # 128 rows for 8 experts
        assert calls == [1]
        moe(torch.randn(1, 2, 64).bfloat16())  # 4 rows: the idle-expert path
        moe.float()(torch.randn(2, 32, 64))  # fp32: MKL, no per-shape kernels, unpadded
        assert calls == [1]


def test_compiled_experts_pad_rows_with_one_graph_for_every_routing():
    # fullgraph: no data-dependent shape and no host read in the compiled aligned path; one frame for three
    # routings: nothing recompiles as the per-expert counts change. Values and gradients as eager's aligned path.
    moe = _moe().to(torch.bfloat16)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(moe.experts, backend=counter, fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    for seed in range(3):
        x = torch.randn(45, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
        results = []
        for experts in (moe.experts, compiled):
            moe.zero_grad()
            xg = x.clone().requires_grad_(True)
            routing = moe.gate(xg)
            y, counts = experts(xg, routing)
            (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            results.append([y.detach(), counts] + [p.grad.clone() for p in moe.experts.parameters()] + [xg.grad])
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    assert counter.frame_count == 1
    graph = counter.graphs[0]
    assert "index_copy" in graph.code  # the padded layout (aligned_rows), not the plain dispatch
    # Every traced tensor has a static shape: no size read back from the data (an unbacked SymInt).
    values = [node.meta.get("example_value") for node in graph.graph.nodes]
    shapes = [v.shape for v in values if isinstance(v, torch.Tensor)]
    assert shapes and all(isinstance(d, int) for shape in shapes for d in shape)
