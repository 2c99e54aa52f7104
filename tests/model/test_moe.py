"""Router selection, grouped dispatch vs a per-expert loop, and the balancing-bias update."""

import torch

from openk2.model.moe import MoE, Router
from openk2.model.stats import ForwardStats

from .conftest import small_config


def _router(**overrides) -> Router:
    torch.manual_seed(0)
    router = Router(small_config(**overrides))
    torch.nn.init.normal_(router.weight, std=0.5)
    return router


def test_router_selects_top_k_by_score_and_weights_from_unbiased_scores():
    router = _router(norm_topk_prob=False, routed_scaling_factor=1.0)
    x = torch.randn(10, 48)
    r = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    expected = scores.topk(2, dim=-1).indices.sort(-1).values
    assert torch.equal(r.indices_NK.sort(-1).values, expected)
    torch.testing.assert_close(r.weights_NK, scores.gather(1, r.indices_NK))


def test_bias_changes_selection_but_not_weights():
    router = _router(norm_topk_prob=True, routed_scaling_factor=2.5)
    x = torch.randn(64, 48)
    router.e_score_correction_bias[3] = 10.0  # expert 3 is now always chosen
    r = router(x)
    assert (r.indices_NK == 3).any(dim=-1).all()
    scores = torch.sigmoid(x @ router.weight.T)
    picked = scores.gather(1, r.indices_NK)
    torch.testing.assert_close(r.weights_NK, 2.5 * picked / picked.sum(-1, keepdim=True))


def test_group_limited_routing_stays_within_top_groups():
    router = _router(n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=2)
    r = router(torch.randn(32, 48))
    groups = r.indices_NK // 2
    assert (groups[:, 0] == groups[:, 1]).all()


def _random_moe(cfg) -> MoE:
    """A MoE block with all weights N(0, 0.3), so routing and expert outputs are far from trivial."""
    moe = MoE(cfg, cfg.first_k_dense_replace)  # the first MoE layer's index
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def _loop_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    routing = moe.gate(x)
    out = torch.zeros_like(x)
    ex = moe.experts
    for n in range(x.shape[0]):
        for slot in range(routing.indices_NK.shape[1]):
            e = routing.indices_NK[n, slot]
            h = torch.nn.functional.silu(ex.gate_proj[e] @ x[n]) * (ex.up_proj[e] @ x[n])
            out[n] += routing.weights_NK[n, slot] * (ex.down_proj[e] @ h)
    return out


def test_grouped_dispatch_equals_per_expert_loop_values_and_grads():
    torch.manual_seed(0)
    cfg = small_config()
    moe = _random_moe(cfg)
    x = torch.randn(23, cfg.hidden_size)
    results = []
    for mode in ("grouped", "fallback", "loop"):
        moe.zero_grad()
        moe.experts.use_grouped_mm = mode == "grouped"
        y = _loop_reference(moe, x) if mode == "loop" else moe.experts(x, moe.gate(x))[0]
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append((y.detach(), [p.grad.clone() for p in moe.experts.parameters()], moe.gate.weight.grad))
    ref_y, ref_g, ref_router = results[2]
    for y, grads, router_grad in results[:2]:
        # Only the summation order differs (fp32 round-off).
        torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
        for g, r in zip(grads, ref_g, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(router_grad, ref_router, rtol=1e-5, atol=1e-5)


def test_tokens_per_expert_and_bias_update():
    torch.manual_seed(0)
    cfg = small_config()
    moe = _random_moe(cfg)
    stats = ForwardStats(cfg)
    moe(torch.randn(2, 9, cfg.hidden_size), stats)
    counts = stats.tokens_per_expert()[0]
    assert counts.sum() == 2 * 9 * cfg.num_experts_per_tok
    moe.update_bias(0.01, counts)
    mean = counts.mean()
    expected = 0.01 * torch.sign(mean - counts)
    torch.testing.assert_close(moe.gate.e_score_correction_bias, expected)


def test_sequence_aux_loss():
    cfg = small_config(aux_loss_alpha=0.1)
    moe = _random_moe(cfg).train()

    def aux_loss(x):
        stats = ForwardStats(cfg)
        moe(x, stats)
        return stats.aux_loss()

    aux = aux_loss(torch.randn(2, 16, cfg.hidden_size))
    assert aux is not None and aux.requires_grad
    # Equal scores make P_i = 1/E, so alpha * sum_i f_i P_i = alpha * sum_i count_i / (K T) = alpha.
    torch.nn.init.zeros_(moe.gate.weight)
    torch.testing.assert_close(aux_loss(torch.randn(1, 8, cfg.hidden_size)), torch.tensor(0.1))
    moe.eval()
    assert aux_loss(torch.randn(1, 8, cfg.hidden_size)) is None
