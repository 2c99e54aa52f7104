import math

import pytest
import torch

from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM
from openk2.rl.loss import (
    budget_penalty,
    decayed_temperature,
    get_loss,
    grpo_loss,
    k15_loss,
    ptx_loss,
    truncate_to_budget,
)


def _k15_loop(logp, logp_old, rewards, tau):
    """The formula written out with Python loops, one prompt and one sample at a time."""
    num_prompts, k = rewards.shape
    total = 0.0
    for p in range(num_prompts):
        mean_r = sum(rewards[p, j] for j in range(k)) / k
        for i in range(k):
            total = total + (rewards[p, i] - mean_r - tau * (logp[p, i] - logp_old[p, i])) ** 2
    return total / (num_prompts * k)


@pytest.mark.parametrize("shape,tau", [((1, 1), 0.1), ((3, 4), 0.5), ((5, 8), 2.0)])
def test_k15_value_and_gradient_match_direct_loop(shape, tau):
    gen = torch.Generator().manual_seed(0)
    logp_init = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    logp_old = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    rewards = torch.rand(shape, generator=gen, dtype=torch.float64)

    logp_a = logp_init.clone().requires_grad_()
    loss_a = k15_loss(logp_a, logp_old, rewards, tau)
    loss_a.backward()
    logp_b = logp_init.clone().requires_grad_()
    loss_b = _k15_loop(logp_b, logp_old, rewards, tau)
    loss_b.backward()

    torch.testing.assert_close(loss_a, loss_b)
    torch.testing.assert_close(logp_a.grad, logp_b.grad)
    # Closed form: d/dlogp_i = -2*tau*(a_i - tau*log_ratio_i) / (P*K).
    adv = rewards - rewards.mean(1, keepdim=True)
    expected = -2 * tau * (adv - tau * (logp_init - logp_old)) / logp_init.numel()
    torch.testing.assert_close(logp_a.grad, expected)


def test_k15_is_zero_at_its_optimum_and_rejects_bad_input():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    logp_old = torch.zeros(1, 4)
    tau = 0.5
    optimum = logp_old + (rewards - rewards.mean()) / tau  # tau*log ratio == centred reward
    assert k15_loss(optimum, logp_old, rewards, tau).item() == pytest.approx(0.0, abs=1e-12)
    assert k15_loss(logp_old, logp_old, rewards, tau).item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match=r"\[P, K\]"):
        k15_loss(torch.zeros(4), torch.zeros(4), torch.zeros(4), tau)
    with pytest.raises(ValueError, match="tau"):
        k15_loss(logp_old, logp_old, rewards, 0.0)


def test_k15_gradient_descent_raises_likelihood_of_better_responses():
    logp = torch.zeros(2, 4, requires_grad=True)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    k15_loss(logp, torch.zeros(2, 4), rewards, tau=1.0).backward()
    step = -logp.grad
    assert torch.equal(step > 0, rewards > rewards.mean(1, keepdim=True))


def test_grpo_sanity():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    logp = torch.zeros(2, 4, requires_grad=True)
    loss = grpo_loss(logp, logp.detach(), rewards)
    # On-policy (ratio 1) the surrogate is the mean advantage, which is zero after normalisation.
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    loss.backward()
    # Better-than-average responses are pushed up, worse ones down; an all-equal group gives no signal.
    assert torch.all(logp.grad[0, [0, 3]] < 0) and torch.all(logp.grad[0, [1, 2]] > 0)
    assert torch.all(logp.grad[1] == 0)
    # The clip: past 1+eps a positive-advantage sample gets no more gradient.
    far = torch.tensor([[0.5, 0.0, 0.0, 0.0]], requires_grad=True)  # ratio e^0.5 > 1.2 on sample 0
    grpo_loss(far, torch.zeros(1, 4), torch.tensor([[1.0, 0.0, 0.0, 0.0]]), clip_eps=0.2).backward()
    assert far.grad[0, 0] == 0


def test_grpo_token_level_matches_sequence_level_for_single_tokens():
    gen = torch.Generator().manual_seed(1)
    logp = torch.randn(3, 4, generator=gen) * 0.1
    logp_old = torch.randn(3, 4, generator=gen) * 0.1
    rewards = torch.rand(3, 4, generator=gen)
    seq = grpo_loss(logp, logp_old, rewards)
    # Pad each one-token sequence with masked garbage tokens: the result must not change.
    tok = torch.cat([logp.unsqueeze(-1), torch.randn(3, 4, 2, generator=gen)], -1)
    tok_old = torch.cat([logp_old.unsqueeze(-1), torch.randn(3, 4, 2, generator=gen)], -1)
    mask = torch.tensor([1.0, 0.0, 0.0]).expand(3, 4, 3)
    torch.testing.assert_close(grpo_loss(tok, tok_old, rewards, mask=mask), seq)


def test_loss_registry():
    assert get_loss("k15") is k15_loss and get_loss("grpo") is grpo_loss
    with pytest.raises(ValueError, match="unknown RL loss"):
        get_loss("ppo")


def test_budget_control():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    num_tokens = torch.tensor([10, 64, 64, 30])
    out = budget_penalty(rewards, num_tokens, 64, penalty=0.5)
    assert out.tolist() == [1.0, 0.5, -0.5, 1.0]
    per_response = budget_penalty(rewards, num_tokens, torch.tensor([10, 100, 100, 100]), penalty=1.0)
    assert per_response.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert truncate_to_budget([1, 2, 3, 4], 3) == ([1, 2, 3], True)
    assert truncate_to_budget([1, 2], 3) == ([1, 2], False)
    with pytest.raises(ValueError):
        budget_penalty(rewards, num_tokens, 64, penalty=-1)


def test_ptx_loss_is_weighted_lm_loss():
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, n_routed_experts=4, dtype="float32")
    model = K2ForCausalLM(cfg)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    lm = model(ids, labels=ids).loss
    loss = ptx_loss(model, ids, weight=0.1)
    torch.testing.assert_close(loss, 0.1 * lm)
    loss.backward()
    assert any(p.grad is not None for p in model.parameters())


def test_temperature_decay():
    for schedule in ("linear", "cosine", "exponential"):
        temps = [decayed_temperature(s, 1.2, 0.6, 10, schedule) for s in range(-1, 13)]
        assert temps[0] == pytest.approx(1.2) and temps[1] == pytest.approx(1.2)
        assert temps[-1] == pytest.approx(0.6) and temps[11] == pytest.approx(0.6)
        assert all(a >= b - 1e-12 for a, b in zip(temps, temps[1:], strict=False))
    assert decayed_temperature(5, 1.0, 0.5, 10, "linear") == pytest.approx(0.75)
    assert decayed_temperature(5, 1.0, 0.25, 10, "exponential") == pytest.approx(0.5)
    assert decayed_temperature(5, 1.0, 0.5, 10, "cosine") == pytest.approx(0.75)
    assert decayed_temperature(2, 1.0, 0.5, 10, "cosine") > decayed_temperature(2, 1.0, 0.5, 10, "linear")
    with pytest.raises(ValueError, match="schedule"):
        decayed_temperature(1, 1.0, 0.5, 10, "step")
    assert not math.isnan(decayed_temperature(0, 1.0, 1.0, 1))
