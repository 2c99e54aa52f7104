"""Partial rollout: paused trajectories resume under new weights with the log-probs they were sampled with."""

import copy

import pytest
import torch

from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM
from openk2.rl.rollout import Group, PartialRollout, new_group
from openk2.rl.tasks import Problem


def _model(seed: int = 0) -> K2ForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig.preset("tiny").replace(vocab_size=300, hidden_size=64, intermediate_size=128,
                                             moe_intermediate_size=32, num_hidden_layers=2, n_routed_experts=4,
                                             num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32,
                                             initializer_range=0.1)
    return K2ForCausalLM(cfg).eval()


def _perturb(model: K2ForCausalLM, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


@torch.no_grad()
def _plain_logprobs(model: K2ForCausalLM, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    logp = model(ids).logits[0].float().log_softmax(-1)
    return logp[len(prompt) - 1: -1].gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def _groups(num: int, k: int, start: int = 0) -> list[Group]:
    gen = torch.Generator().manual_seed(start)
    out = []
    for g in range(start, start + num):
        prompt = torch.randint(0, 300, (3 + g % 4,), generator=gen).tolist()
        out.append(new_group(g, Problem(prompt=f"p{g}"), prompt, k, iteration=0))
    return out


def test_paused_trajectories_resume_with_the_logprobs_they_were_sampled_with():
    model = _model()
    snapshots = {}  # policy version -> the weights that sampled under it
    rollout = PartialRollout(max_tokens=10, segment_tokens=3, max_batch_size=5)  # no stop token: all run to 10
    finished: list[Group] = []
    for iteration in range(5):
        snapshots[iteration] = copy.deepcopy(model)
        new = _groups(2, 3, start=10 * iteration) if iteration < 2 else []
        done, stats = rollout.run(model, None, new, iteration=iteration, version=iteration)
        finished += done
        if iteration == 1:
            assert stats.resumed == 6 and stats.paused == 12  # iteration 0's groups continue, new ones start
        _perturb(model, seed=iteration)  # "training": the next iteration samples under new weights
    assert len(finished) == 4 and not rollout.paused
    for group in finished:
        for traj in group.trajectories:
            assert traj.finish_reason == "length" and len(traj.token_ids) == 10
            assert traj.num_segments == 4  # 3 + 3 + 3 + 1 tokens
            assert len(set(traj.versions)) == 4  # every segment was sampled by a different policy
            expected = torch.empty(len(traj.token_ids))
            for version in set(traj.versions):
                at = [i for i, v in enumerate(traj.versions) if v == version]
                full = _plain_logprobs(snapshots[version], traj.prompt_ids, traj.token_ids)
                expected[at] = full[at]
            torch.testing.assert_close(torch.tensor(traj.logprobs), expected, atol=2e-4, rtol=1e-4)


def test_stop_tokens_finish_early_and_groups_wait_for_all_samples():
    model = _model(1)
    stop = set(range(0, 300, 2))  # even tokens stop a sample: about half stop in the first step
    rollout = PartialRollout(max_tokens=4, segment_tokens=1, stop_token_ids=sorted(stop), max_batch_size=4)
    done, stats = rollout.run(model, None, _groups(6, 4), iteration=0, version=0)
    trajectories = [t for g in done + rollout.paused for t in g.trajectories]
    assert len(trajectories) == 24 and all(len(t.token_ids) == 1 for t in trajectories)
    assert all(t.finished == (t.token_ids[0] in stop) for t in trajectories)
    assert all(g.complete for g in done) and all(not g.complete for g in rollout.paused)
    assert stats.paused == sum(not t.finished for t in trajectories) > 0
    assert stats.completed_groups == len(done)


def test_state_round_trip_and_reproducible_seeds():
    model = _model(2)
    a = PartialRollout(max_tokens=6, segment_tokens=2, seed=3)
    a.run(model, None, _groups(2, 2), iteration=0, version=0)
    b = PartialRollout(max_tokens=6, segment_tokens=2, seed=3)
    b.load_state_dict(a.state_dict())
    done_a, _ = a.run(model, None, [], iteration=1, version=1)
    done_b, _ = b.run(model, None, [], iteration=1, version=1)
    assert [g.to_dict() for g in a.paused] == [g.to_dict() for g in b.paused]
    assert [g.to_dict() for g in done_a] == [g.to_dict() for g in done_b]
    assert all(len(t.token_ids) == 4 for g in a.paused for t in g.trajectories)
    with pytest.raises(ValueError, match="segment_tokens"):
        PartialRollout(max_tokens=4, segment_tokens=0)
