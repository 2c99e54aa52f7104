"""RoutingTrace (R3): recording is exact against the plain forward, replaying the recorded experts is exact,
replaying other experts runs those experts with gate weights from the current scores (router gradients flow),
FREE rows route by themselves, and a recomputed layer replays the same experts."""

import pytest
import torch

from openk2.model import K2ForCausalLM
from openk2.model.moe import Router
from openk2.model.routing import FREE, RoutingTrace, routing_agreement

from .conftest import randomise_extras, small_config


def _model(seed: int = 0, **overrides) -> K2ForCausalLM:
    torch.manual_seed(seed)
    model = K2ForCausalLM(small_config(initializer_range=0.2, **overrides))
    randomise_extras(model, seed)
    return model


def _grads(model: K2ForCausalLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss_and_grads(model, ids, routing=None):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, routing=routing)
    out.loss.backward()
    return out.logits.detach(), _grads(model)


@pytest.mark.parametrize("n_group", [1, 4])
def test_record_and_replay_of_the_recorded_experts_are_exact(n_group):
    model = _model(n_group=n_group, topk_group=2 if n_group > 1 else 1)
    ids = torch.randint(0, 97, (3, 11))
    plain_logits, plain_grads = _loss_and_grads(model, ids)
    trace = RoutingTrace(model.config)
    rec_logits, rec_grads = _loss_and_grads(model, ids, trace)
    assert torch.equal(rec_logits, plain_logits)
    used = trace.used()
    assert used.shape == (3 * 11, len(model.moe_layers()), model.config.num_experts_per_tok)
    assert torch.equal(used, trace.chosen())
    replay = RoutingTrace(model.config, replay=used.view(3, 11, *used.shape[1:]))
    rep_logits, rep_grads = _loss_and_grads(model, ids, replay)
    assert torch.equal(rep_logits, plain_logits)
    assert rep_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        assert torch.equal(rep_grads[name], grad), name
    assert torch.equal(replay.used(), used) and torch.equal(replay.chosen(), used)


def test_replaying_other_experts_runs_them_and_the_router_still_learns():
    model = _model()
    ids = torch.randint(0, 97, (2, 9))
    trace = RoutingTrace(model.config)
    plain_logits, _ = _loss_and_grads(model, ids, trace)
    natural = trace.used()
    forced = (natural + 1) % model.config.n_routed_experts  # every expert differs from the natural pick
    replay = RoutingTrace(model.config, replay=forced)
    logits, grads = _loss_and_grads(model, ids, replay)
    assert torch.equal(replay.used(), forced)
    assert not torch.equal(logits, plain_logits)
    # the first MoE layer sees the same input either way, so its router's own choice is still the natural one
    assert torch.equal(replay.chosen()[:, 0], natural[:, 0])
    for moe in model.moe_layers():
        assert grads[f"model.layers.{moe.layer_idx}.mlp.gate.weight"].abs().sum() > 0


def test_replayed_gate_weights_come_from_current_scores_at_the_replayed_experts():
    torch.manual_seed(0)
    router = Router(small_config(norm_topk_prob=True, routed_scaling_factor=2.5))
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(6, 48)
    replay = torch.tensor([[0, 1], [2, 3], [FREE, FREE], [7, 6], [5, 0], [FREE, 4]])
    r = router(x, replay)
    free = router(x)
    own = torch.tensor([True, True, False, True, True, False])
    assert torch.equal(r.indices_NK[own], replay[own])
    assert torch.equal(r.indices_NK[~own], free.indices_NK[~own])  # a row with any FREE routes by itself
    assert torch.equal(r.chosen_NK, free.indices_NK)
    scores = torch.sigmoid(x @ router.weight.T)
    picked = scores.gather(1, r.indices_NK)
    torch.testing.assert_close(r.weights_NK, 2.5 * picked / picked.sum(-1, keepdim=True))


def test_all_free_replay_is_the_plain_forward():
    model = _model()
    ids = torch.randint(0, 97, (2, 7))
    plain_logits, plain_grads = _loss_and_grads(model, ids)
    layers, k = len(model.moe_layers()), model.config.num_experts_per_tok
    logits, grads = _loss_and_grads(model, ids, RoutingTrace(model.config, replay=torch.full((14, layers, k), FREE)))
    assert torch.equal(logits, plain_logits)
    assert all(torch.equal(grads[n], g) for n, g in plain_grads.items())


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_layers_replay_the_same_experts(mode):
    from openk2.train.memory import MemorySection, apply_memory_options

    model = _model()
    ids = torch.randint(0, 97, (2, 9))
    trace = RoutingTrace(model.config)
    model(ids, routing=trace)
    forced = (trace.used() + 3) % model.config.n_routed_experts
    _, plain_grads = _loss_and_grads(model, ids, RoutingTrace(model.config, replay=forced))
    handle = apply_memory_options(model, MemorySection(recompute=mode))
    try:
        replay = RoutingTrace(model.config, replay=forced)
        _, grads = _loss_and_grads(model, ids, replay)
    finally:
        handle.remove()
    assert torch.equal(replay.used(), forced)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bad_replay_is_a_value_error():
    cfg = small_config()
    layers, k = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)), cfg.num_experts_per_tok
    with pytest.raises(ValueError, match="replay must be"):
        RoutingTrace(cfg, replay=torch.zeros(4, layers + 1, k, dtype=torch.long))
    with pytest.raises(ValueError, match="expert ids"):
        RoutingTrace(cfg, replay=torch.full((4, layers, k), cfg.n_routed_experts))
    model = _model()
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(1, 5, dtype=torch.long),
              routing=RoutingTrace(cfg, replay=torch.zeros(4, layers, k, dtype=torch.long)))
    with pytest.raises(ValueError, match="recorded no routing"):
        RoutingTrace(cfg).used()


def test_routing_agreement_counts_shared_experts_per_token_and_layer():
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    b = torch.tensor([[[1, 0], [2, 0]], [[0, 1], [7, 6]]])
    assert routing_agreement(a, b) == pytest.approx(5 / 8)
    assert routing_agreement(a, b, torch.tensor([True, False])) == pytest.approx(3 / 4)
    assert routing_agreement(a, a) == 1.0
    assert routing_agreement(a[:0], b[:0]) != routing_agreement(a[:0], b[:0])  # nan
    with pytest.raises(ValueError, match="differ in shape"):
        routing_agreement(a, b[:1])
