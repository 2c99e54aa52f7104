"""Routing recorded by the engine, replayed in training (R3), and the train/rollout mismatch statistics."""

import copy
import json

import pytest
import torch

from openk2.config import ModelConfig
from openk2.infer.engine import Engine
from openk2.infer.sampling import SamplingParams
from openk2.model import K2ForCausalLM
from openk2.rl.mismatch import abs_diff_summary, measure, mismatch_record
from openk2.rl.rollout import PartialRollout, Trajectory, new_group
from openk2.rl.routing_replay import extend_routing, moe_layer_count, replay_tensor, replay_trace
from openk2.rl.tasks import Problem


def _config(**overrides) -> ModelConfig:
    base = dict(vocab_size=61, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                first_k_dense_replace=1, max_position_embeddings=128, initializer_range=0.3)
    base.update(overrides)
    return ModelConfig(**base)


def _model(seed: int = 0, **overrides) -> K2ForCausalLM:
    torch.manual_seed(seed)
    return K2ForCausalLM(_config(**overrides)).eval()


def _rollout(model, prompts, samples=2, max_tokens=6, seed=0, record=True):
    engine = Engine(model, max_batch_size=8, max_seq_len=64, record_routing=record)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, n=samples, ignore_eos=True)
    return [(r, Trajectory.from_result(r)) for r in engine.generate(prompts, params)]


def test_engine_records_the_experts_that_produced_each_token_and_changes_nothing_else():
    model = _model()
    prompts = [[3, 4, 5, 6, 7], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18]]
    plain = Engine(model, max_batch_size=8, max_seq_len=64).generate(
        prompts, SamplingParams(max_tokens=6, seed=1, n=2, ignore_eos=True))
    recorded = _rollout(model, prompts, seed=1)
    layers, k = moe_layer_count(model.config), model.config.num_experts_per_tok
    for p, (r, _) in zip(plain, recorded, strict=True):
        assert r.token_ids == p.token_ids and r.logprobs == p.logprobs and p.routing is None
        assert r.routing.shape == (len(r.prompt_token_ids) + len(r.token_ids) - 1, layers, k)
        assert r.routing.dtype == torch.int16
    # a plain fp32 training forward picks the same experts at the position that produced each token
    trajectories = [t for _, t in recorded]
    m = measure(model, trajectories, pad_id=0, replay=False)
    assert m.tokens == sum(len(t.token_ids) for t in trajectories)
    assert m.route_agree == 1.0
    assert m.logp_diff["max"] < 1e-4


def test_prefix_cache_hits_are_unrecorded_positions_that_route_freely():
    model = _model()
    shared = list(range(1, 40))  # two full 16-token blocks shared by the second request
    engine = Engine(model, max_batch_size=4, max_seq_len=64, block_size=16, record_routing=True)
    params = SamplingParams(max_tokens=4, seed=0, ignore_eos=True)
    first = engine.generate([shared + [50]], params)[0]
    second = engine.generate([shared + [51, 52]], params)[0]
    assert engine.cache.hits == 2
    assert (first.routing >= 0).all()
    assert (second.routing[:32] == -1).all() and (second.routing[32:] >= 0).all()
    traj = Trajectory(list(second.prompt_token_ids))
    traj.routing = []
    extend_routing(traj, second.routing, len(second.prompt_token_ids))
    traj.token_ids, traj.logprobs, traj.versions = list(second.token_ids), list(second.logprobs), [0] * 4
    replay = replay_tensor([traj], model.config)
    assert (replay[0, :32] == -1).all() and torch.equal(replay[0, 32:-1], second.routing[32:].long())
    m = measure(model, [traj], 0, replay=True)
    assert m.route_agree == 1.0 and m.logp_diff["max"] < 1e-4


def test_replay_covers_every_recorded_position_and_only_complete_records():
    cfg = _config()
    layers, k = moe_layer_count(cfg), cfg.num_experts_per_tok
    a = Trajectory([1, 2, 3], [4, 5], [0.0, 0.0], [0, 0], "stop")
    a.routing = [[p, p + 1] * layers for p in range(4)]
    b = Trajectory([1], [4, 5, 6, 7], [0.0] * 4, [0] * 4, "stop")
    b.routing = [[0, 1] * layers]  # incomplete: routes by itself everywhere
    replay = replay_tensor([a, b], cfg)
    assert replay.shape == (2, 5, layers, k)
    assert [replay[0, p].tolist() for p in range(4)] == [[[p, p + 1]] * layers for p in range(4)]
    assert (replay[0, 4] == -1).all() and (replay[1] == -1).all()
    b.routing = []
    assert replay_trace([b], cfg) is None
    assert replay_trace([a], _config(first_k_dense_replace=3)) is None  # dense model: nothing to replay


def test_replay_removes_a_pure_routing_mismatch():
    """The rollout's router has a different balancing bias (it changes which experts are chosen, never the gate
    weights): without replay the training forward routes elsewhere and its log-probs differ; replaying the
    rollout's experts at every position gives back its log-probs."""
    policy = _model(seed=2)
    rollout_model = copy.deepcopy(policy)
    with torch.no_grad():
        for moe in rollout_model.moe_layers():
            moe.gate.e_score_correction_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(5)))
    prompts = [[7, 8, 9], [19], [23, 24, 25, 26, 27], [40, 41]]
    trajectories = [t for _, t in _rollout(rollout_model, prompts, samples=3, max_tokens=8)]
    record = mismatch_record(policy, trajectories, pad_id=0)
    assert record["mismatch_tokens"] == record["mismatch_tokens_r3"] == 4 * 3 * 8
    assert record["route_agree"] < 0.9
    assert record["logp_diff_max"] > 1e-2
    assert record["logp_diff_max_r3"] < 1e-4
    # and the replayed forward ran exactly the rollout's experts at those positions
    trace = replay_trace(trajectories, policy.config)
    ids = torch.zeros(len(trajectories), 13, dtype=torch.long)
    for b, t in enumerate(trajectories):
        ids[b, : len(t.prompt_ids) + 8] = torch.tensor(t.prompt_ids + t.token_ids)
    with torch.no_grad():
        policy(ids, routing=trace)
    used, replay = trace.used().view(len(trajectories), 13, -1, 2), replay_tensor(trajectories, policy.config)
    recorded = replay[..., 0] >= 0
    assert recorded.sum() == sum(len(t.prompt_ids) + 7 for t in trajectories) * moe_layer_count(policy.config)
    assert torch.equal(used[recorded], replay[recorded])


def test_a_resumed_segment_keeps_the_rows_the_earlier_one_sampled_from():
    cfg = _config()
    layers = moe_layer_count(cfg)
    traj = Trajectory([1, 2, 3])
    traj.routing = []
    seg1 = torch.arange(4 * layers * 2).view(4, layers, 2)  # prompt 3 + 2 tokens: positions 0..3
    extend_routing(traj, seg1, 3)
    traj.token_ids += [4, 5]
    seg2 = 100 + torch.arange(6 * layers * 2).view(6, layers, 2)  # re-prefill of 5 + 2 new tokens: 0..5
    extend_routing(traj, seg2, 5)
    traj.token_ids += [6, 7]
    assert traj.routing == seg1.flatten(1).tolist() + seg2[4:].flatten(1).tolist()
    extend_routing(traj, None, 7)  # a segment without a record drops the whole record
    assert traj.routing == []


def test_only_tokens_of_the_current_policy_version_count():
    policy = _model()
    (_, traj), = _rollout(policy, [[5, 6]], samples=1, max_tokens=6)
    traj.versions = [0, 0, 0, 1, 1, 1]
    traj.logprobs = traj.logprobs[:3] + [lp - 5.0 for lp in traj.logprobs[3:]]  # older policy: far away
    assert measure(policy, [traj], 0, replay=False, version=0).logp_diff["max"] < 1e-4
    assert measure(policy, [traj], 0, replay=False, version=1).logp_diff["median"] == pytest.approx(5.0, abs=1e-3)
    assert measure(policy, [traj], 0, replay=False).tokens == 6


def test_summary_and_bad_input():
    s = abs_diff_summary(torch.tensor([0.5, -0.25, 0.0, 1.0]))
    assert s["max"] == 1.0 and s["median"] == pytest.approx(0.375) and s["mean"] == pytest.approx(0.4375)
    assert all(v != v for v in abs_diff_summary(torch.zeros(0)).values())
    with pytest.raises(ValueError, match="at least one trajectory"):
        measure(_model(), [], 0, replay=False)


def test_dense_model_reports_logp_mismatch_without_routing():
    policy = _model(first_k_dense_replace=3)
    trajectories = [t for _, t in _rollout(policy, [[5, 6, 7]], samples=2)]
    record = mismatch_record(policy, trajectories, pad_id=0)
    assert record["logp_diff_max"] < 1e-4 and record["route_agree"] != record["route_agree"]
    assert not any(key.endswith("_r3") for key in record)


def test_partial_rollout_records_routing_across_segments_and_replay_recovers_its_logprobs():
    """A pure routing mismatch (the rollout copy's balancing bias differs) through paused and resumed segments:
    every finished trajectory has a complete record, and replaying it gives back the rollout's log-probs,
    which the free-routing training forward does not."""
    policy = _model(seed=3)
    rollout_model = copy.deepcopy(policy)
    with torch.no_grad():
        for moe in rollout_model.moe_layers():
            moe.gate.e_score_correction_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(1)))
    rollout = PartialRollout(max_tokens=10, segment_tokens=4, max_batch_size=6, record_routing=True)
    finished: list[Trajectory] = []
    fresh = [new_group(g, Problem(prompt=f"p{g}"), [7 + g, 8, 9 + g][: 1 + g % 3], 2, iteration=0) for g in range(3)]
    for iteration in range(3):
        done, stats = rollout.run(rollout_model, None, fresh if iteration == 0 else [], iteration=iteration,
                                  version=0)
        finished += [t for g in done for t in g.trajectories]
    assert len(finished) == 6 and all(t.num_segments == 3 for t in finished)
    assert all(len(t.routing) == len(t.prompt_ids) + len(t.token_ids) - 1 for t in finished)
    record = mismatch_record(policy, finished, pad_id=0)
    assert record["mismatch_tokens"] == 60 and record["route_agree"] < 0.95
    assert record["logp_diff_max"] > 1e-2 and record["logp_diff_max_r3"] < 1e-4
    state = rollout.state_dict()  # paused groups with their records stay JSON
    assert json.loads(json.dumps(state)) == state


def test_rl_iterations_log_the_mismatch_of_bf16_rollouts_with_and_without_replay(tmp_path):
    from openk2.rl.config import load_rl_config
    from openk2.rl.trainer import RLTrainer
    from tests.rl.test_trainer import CONFIG, MICRO

    threads = torch.get_num_threads()
    try:
        cfg = load_rl_config(CONFIG, [*MICRO, "rollout.routing_replay=true", "rollout.inference_dtype='bf16'"])
        trainer = RLTrainer(cfg, tmp_path / "run")
        assert trainer.inference.model.embed_tokens.weight.dtype == torch.bfloat16
        records = [trainer.iterate() for _ in range(2)]
    finally:
        torch.set_num_threads(threads)
    measured = [r for r in records if "logp_diff_max" in r]
    assert measured  # groups complete within two iterations (segment 8, budget 12)
    for r in measured:
        for suffix in ("", "_r3"):
            assert r[f"mismatch_tokens{suffix}"] > 0
            assert 0 < r[f"logp_diff_median{suffix}"] <= r[f"logp_diff_p99{suffix}"] <= r[f"logp_diff_max{suffix}"]
            assert 0.5 < r[f"route_agree{suffix}"] <= 1.0
    with pytest.raises(ValueError, match="inference_dtype"):
        load_rl_config(CONFIG, ["rollout.inference_dtype='fp8'"])
    with pytest.raises(ValueError, match="mismatch_every"):
        load_rl_config(CONFIG, ["rollout.mismatch_every=-1"])
