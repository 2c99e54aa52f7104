"""R3 for multi-turn tool episodes: every turn's engine request records its experts, the episode keeps those of
prompt, policy and tool positions, and replaying them in the training forward gives back the rollout's
log-probs, on a micro model under a pure routing mismatch (the rollout copy's balancing bias differs).

The policies here are random, so their turns are scripted through the engine's constrained decoding: the
constraint picks the token, the engine still runs the model and records the raw log-probs and the experts."""

import copy
import dataclasses
import re

import pytest
import torch

from openk2.chat import ChatFormat
from openk2.config import ModelConfig
from openk2.data.tokenizer import train_tokenizer
from openk2.infer.engine import Engine
from openk2.model import K2ForCausalLM
from openk2.model.routing import FREE
from openk2.rl import tool_rollout
from openk2.rl.mismatch import mismatch_record
from openk2.rl.rollout import Trajectory
from openk2.rl.routing_replay import expected_rows, pad_routing, replay_tensor, replay_trace, share_cached_rows
from openk2.rl.tasks import get
from openk2.rl.tool_episode import Episode
from openk2.rl.tool_rollout import run_episodes
from openk2.rl.tool_warmup import tool_example
from openk2.rl.trainer import _pack_sequences

CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>"
        '{{"item": "{item}"}}<|tool_call_end|><|tool_calls_section_end|>')


class Forced:
    """A constraint that allows exactly one token at each step: `ids`, then it is complete."""

    def __init__(self, ids: list[int], vocab: int) -> None:
        self.ids, self.vocab, self.at = ids, vocab, 0

    def allowed(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        mask[self.ids[min(self.at, len(self.ids) - 1)]] = True
        return mask

    def advance(self, token: int) -> None:
        self.at += 1

    def is_terminated(self) -> bool:
        return self.at >= len(self.ids)


def scripted_engine(fmt: ChatFormat, vocab: int, answer_right=lambda episode: True):
    """An Engine whose tool-episode turns are scripted from the conversation: turn 0 looks the asked item up,
    turn 1 answers with the looked-up price (or a wrong one where `answer_right(episode index)` is False)."""

    class Scripted(Engine):
        def add_request(self, prompt, params, request_id=None):
            episode, turn = (int(x) for x in str(request_id).split(":"))
            text = fmt.tokenizer.decode(prompt)
            if turn == 0:
                script = CALL.format(item=re.search(r'one "([^"]+)"', text).group(1))
            else:
                price = int(re.findall(r": (\d+)<\|im_end\|>", text)[-1])
                script = f"Answer: {price if answer_right(episode) else price + 1}"
            ids = fmt.tokenizer.encode(script, allow_special=True) + [fmt.end_of_turn_id]
            params = dataclasses.replace(params, constraint=lambda: Forced(ids, vocab))
            return super().add_request(prompt, params, request_id=request_id)

    return Scripted


@pytest.fixture(scope="module")
def fmt():
    task = get("lookup")
    texts = ["".join(t for t, _ in tool_example(task, task.generate(s, 1))) for s in range(40)]
    return ChatFormat(train_tokenizer(texts, 600))


def _policy(vocab: int) -> K2ForCausalLM:
    torch.manual_seed(0)
    return K2ForCausalLM(ModelConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=512, initializer_range=0.3)).eval()


def _biased(policy: K2ForCausalLM) -> K2ForCausalLM:
    """The same weights with another balancing bias: other experts are chosen, the gate weights are the same."""
    other = copy.deepcopy(policy)
    with torch.no_grad():
        for moe in other.moe_layers():
            bias = moe.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.numel(), generator=torch.Generator().manual_seed(5)))
    return other


def test_tool_episodes_record_every_position_and_replay_recovers_the_rollouts_logprobs(fmt, monkeypatch):
    vocab = fmt.tokenizer.vocab_size
    policy = _policy(vocab)
    monkeypatch.setattr(tool_rollout, "Engine", scripted_engine(fmt, vocab))
    task = get("lookup")
    problems = [task.generate(s, 1) for s in (1, 2, 3)]
    # two samples of problem 1 (the same scripted turns), and two other problems
    episodes = [Episode(task, p, fmt, 80, 400, 3) for p in (problems[0], *problems)]
    # one at a time: the second sample's first turn reads the first's prompt blocks from the prefix cache
    run_episodes(_biased(policy), fmt.tokenizer, episodes, [11, 12, 13, 14], temperature=1.0, max_batch_size=1,
                 record_routing=True)
    trajectories = [ep.traj for ep in episodes]
    for traj in trajectories:
        assert (traj.finish_reason, traj.turns, traj.tool_calls, traj.reward) == ("stop", 2, 1, 1.0)
        assert 0 in traj.mask and traj.mask[-1] == 1  # tool text between the two policy turns
        assert len(traj.routing) == expected_rows(traj)
        assert all(row[0] != FREE for row in traj.routing)  # the cache hits got their computing sample's experts
    assert trajectories[0].token_ids == trajectories[1].token_ids  # the scripted turns are the same

    record = mismatch_record(policy, trajectories, fmt.tokenizer.pad_id)
    assert record["mismatch_tokens"] == record["mismatch_tokens_r3"] == sum(t.num_sampled for t in trajectories)
    assert record["route_agree"] < 0.95 and record["logp_diff_max"] > 1e-2  # the pure routing mismatch
    assert record["logp_diff_max_r3"] < 1e-4  # replayed: the rollout's log-probs, both turns

    # the replayed forward ran exactly the rollout's experts at every position before the last token
    trace = replay_trace(trajectories, policy.config)
    ids, _, _ = _pack_sequences(trajectories, fmt.tokenizer.pad_id)
    with torch.no_grad():
        policy(ids, routing=trace)
    replay = replay_tensor(trajectories, policy.config)
    used = trace.used().view(*replay.shape)
    recorded = replay[..., 0, 0] != FREE
    assert int(recorded.sum()) == sum(expected_rows(t) for t in trajectories)
    assert torch.equal(used[recorded], replay[recorded])


def test_trailing_tool_text_and_shared_prefixes():
    a = Trajectory([1, 2], [3, 4, 5], mask=[1, 0, 0])
    a.routing = [[0, 1], [2, 3]]  # the engine ran positions 0..1 and 2 (the policy's turn)
    a.routing.append([4, 5])
    pad_routing(a)  # the two tool tokens after it: no turn fed the last one, and nothing is sampled after it
    assert a.routing == [[0, 1], [2, 3], [4, 5], [FREE, FREE]]
    b = Trajectory([1, 2], [3, 9], mask=[1, 1])
    b.routing = [[FREE, FREE], [FREE, FREE], [6, 7]]  # its prompt came from a's cached blocks
    c = Trajectory([1, 7], [3, 9], mask=[1, 1])
    c.routing = [[FREE, FREE], [FREE, FREE], [8, 8]]  # another prompt: nothing to take from a
    assert share_cached_rows([a, b, c]) == 3  # b's two prompt rows, and c's first (the same prefix [1])
    assert b.routing == [[0, 1], [2, 3], [6, 7]]
    assert c.routing == [[0, 1], [FREE, FREE], [8, 8]]  # position 0 has the same prefix [1]; position 1 does not


def test_rl_iteration_replays_tool_groups_and_starts_at_log_ratio_zero(tmp_path, monkeypatch):
    """`rollout.routing_replay = true` on a lookup run whose rollout copy routes elsewhere: the mismatch monitor
    sees the flip on the tool groups (R3 off) and none with replay, and the first update's log-ratio is ~0."""
    from openk2.rl.config import load_rl_config
    from openk2.rl.trainer import RLTrainer
    from tests.rl.test_tool_loop import TOOLS
    from tests.rl.test_trainer import MICRO

    threads = torch.get_num_threads()
    try:
        cfg = load_rl_config(TOOLS, [*MICRO, "warmup.steps=0", "warmup.probe_problems=0", "task.eval_problems=4",
                                     "rollout.prompts_per_iteration=2", "rollout.routing_replay=true"])
        trainer = RLTrainer(cfg, tmp_path / "run")
        fmt = ChatFormat(trainer.tokenizer)
        k = cfg.rollout.samples_per_prompt
        monkeypatch.setattr(tool_rollout, "Engine", scripted_engine(fmt, trainer.policy.config.vocab_size,
                                                                    answer_right=lambda i: i % k == 0))
        trainer.inference = _biased(trainer.inference)
        trainer.placement.inference = trainer.inference
        record = trainer.iterate()
    finally:
        torch.set_num_threads(threads)
    assert record["groups_trained"] == 2 and record["updates"] == 1 and record["turns/lookup"] == 2.0
    assert record["reward_mean"] == pytest.approx(1 / k)  # one right answer per group: every group informative
    assert record["route_agree"] < 0.95 and record["logp_diff_max"] > 1e-2
    assert record["logp_diff_max_r3"] < 1e-4 and record["route_agree_r3"] < 0.95
    assert record["log_ratio_abs"] < 2e-3  # pi_theta == pi_old at the first update, through the replayed experts
