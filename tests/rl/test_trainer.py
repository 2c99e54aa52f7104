"""The colocated RL loop end to end on a micro config: it runs, logs, checkpoints (HF layout) and resumes."""

import json
from pathlib import Path

import pytest
import torch

from openk2.cli.rl import rl_main
from openk2.data.tokenizer import K2Tokenizer
from openk2.model import K2ForCausalLM
from openk2.rl.config import load_rl_config
from openk2.rl.rollout import PartialRollout
from openk2.rl.trainer import RLTrainer, build_rl_optimizer, response_logprobs
from openk2.rl.warmup import worked_solution
from openk2.train.metrics import read_metrics

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "rl-tiny.toml"
MICRO = [  # the shipped config, shrunk to seconds
    "model.hidden_size=64", "model.intermediate_size=128", "model.moe_intermediate_size=32", "model.q_lora_rank=32",
    "model.n_routed_experts=4", "warmup.steps=10", "warmup.batch_size=8", "warmup.tokenizer_examples=300",
    "task.eval_problems=8", "rollout.prompts_per_iteration=3", "rollout.samples_per_prompt=3",
    "rollout.max_tokens=12", "rollout.segment_tokens=8", "rollout.max_batch_size=16",
    "rollout.temperature_decay_iterations=4", "train.iterations=4", "train.updates_per_iteration=1",
    "train.eval_every=2", "train.checkpoint_every=2", "train.threads=1",
]



def test_worked_solution_follows_precedence():
    assert worked_solution("3+5*2") == "5*2=10\n3+10=13\nAnswer: 13"
    assert worked_solution("7-2-3") == "7-2=5\n5-3=2\nAnswer: 2"
    assert worked_solution("4") == "Answer: 4"
    with pytest.raises(ValueError):
        worked_solution("3+")


def test_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown key"):
        load_rl_config(CONFIG, ["rollout.temprature=1.0"])
    with pytest.raises(ValueError, match="samples_per_prompt"):
        load_rl_config(CONFIG, ["rollout.samples_per_prompt=1"])


def test_config_rejects_bad_option_values():
    for override, message in [("task.eval_samples=0", "eval_samples"), ("loss.logp_reduction='max'", "sum or mean"),
                              ("optim.optimizer='rmsprop'", "muon, adamw or sgd"), ("optim.momentum=1.0", "momentum")]:
        with pytest.raises(ValueError, match=message):
            load_rl_config(CONFIG, [override])
    cfg = load_rl_config(CONFIG, ["optim.optimizer='sgd'", "loss.logp_reduction='mean'", "task.eval_samples=4"])
    assert (cfg.optim.optimizer, cfg.loss.logp_reduction, cfg.task.eval_samples) == ("sgd", "mean", 4)


@pytest.mark.slow
def test_rl_loop_runs_checkpoints_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--config", str(CONFIG), "--out-dir", str(out)] + [a for m in MICRO for a in ("--set", m)]
    assert rl_main([*args, "--max-iterations", "3"]) == 0
    assert "held-out reward" in capsys.readouterr().out
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert "eval_reward" in records[0] and "eval_reward" in records[2]
    trained = [r for r in records[1:] if r["groups_trained"]]
    assert trained  # groups complete within two iterations (segment 8, budget 12)
    for r in trained:
        for key in ("reward_mean", "entropy", "response_len", "loss", "paused", "sync_gb_s"):
            assert key in r, key
    assert any(r["paused"] > 0 for r in records[1:])  # segment_tokens=8 < most answers: partial rollout ran
    assert (out / "rl_curves.png").is_file()

    ckpt = out / "checkpoints" / "step-0000003"
    state = json.loads((ckpt / "rl_state.json").read_text())
    assert state["iteration"] == 3
    policy = K2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)  # HF layout: `openk2 serve` loads it
    K2Tokenizer.load(ckpt)

    # Resume: one more iteration, continuing the paused groups; the metrics file holds each step once.
    cfg = load_rl_config(CONFIG, MICRO)
    trainer = RLTrainer(cfg, out, resume=True)
    assert trainer.iteration == 3 and len(trainer.rollout.paused) == len(state["rollout"]["paused"])
    for a, b in zip(policy.state_dict().values(), trainer.policy.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    summary = trainer.run()
    assert summary.iteration == 4 and summary.checkpoint.name == "step-0000004"
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    if state["rollout"]["paused"]:
        assert records[-1]["resumed"] > 0


def test_training_logprobs_match_the_engines_before_any_update(tmp_path):
    cfg = load_rl_config(CONFIG, MICRO + ["warmup.steps=0"])
    trainer = RLTrainer(cfg, tmp_path)
    groups = [trainer._new_group() for _ in range(3)]
    rollout = PartialRollout(max_tokens=trainer.max_tokens, max_batch_size=16, stop_token_ids=[trainer.im_end])
    done, _ = rollout.run(trainer.inference, trainer.tokenizer, groups, iteration=0, version=0)
    trajectories = [t for g in done for t in g.trajectories]
    with torch.no_grad():
        logp, entropy = response_logprobs(trainer.policy.eval(), trajectories, trainer.tokenizer.pad_id)
    # pi_theta == pi_old at the first update: the K1.5 log-ratio starts at 0 (up to engine vs training numerics).
    torch.testing.assert_close(logp, torch.tensor([t.logprob_old for t in trajectories]), atol=2e-3, rtol=1e-4)
    assert entropy > 0


class _FirstSampleRight:
    """A stand-in verifier: reward 1 for the first sample of a group when `informative`, else 0 for all."""

    def __init__(self, informative: bool):
        self.informative, self.calls = informative, 0

    def verify(self, problem, response_text):
        self.calls += 1
        return float(self.informative and self.calls % 3 == 1)  # MICRO: 3 samples per group


def _finished_groups(trainer):
    groups = [trainer._new_group() for _ in range(3)]
    rollout = PartialRollout(max_tokens=trainer.max_tokens, max_batch_size=16, stop_token_ids=[trainer.im_end])
    done, _ = rollout.run(trainer.inference, trainer.tokenizer, groups, iteration=0, version=0)
    assert len(done) == 3
    return done


def _weights(model):
    return [q.detach().clone() for q in model.parameters()]


@pytest.mark.parametrize("drop", [True, False])
def test_groups_without_reward_signal_take_no_step(tmp_path, drop):
    """The pipeline stage's regression (docs/rl.md): groups whose K rewards are all 0 have zero advantage, so their
    gradient is only the regulariser on log pi - log pi_old, here engine-vs-training rounding. A batch of only such
    groups must leave the policy (and the optimizer's momentum) as it is, whether or not mixed batches drop them."""
    cfg = load_rl_config(CONFIG, MICRO + ["warmup.steps=0", "loss.budget_penalty=0.0",
                                          f"loss.drop_uniform_groups={str(drop).lower()}"])
    trainer = RLTrainer(cfg, tmp_path)
    groups = _finished_groups(trainer)
    trainer.envs[0].task = _FirstSampleRight(informative=False)
    before = _weights(trainer.policy)
    record = trainer._train(groups)
    assert record["groups_informative"] == 0 and record["reward_mean"] == 0.0 and record["updates"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(trainer.policy), strict=True))
    assert not trainer.optimizer.state_dict()["muon"]["state"]


def test_muon_step_ignores_the_gradients_scale(tmp_path):
    """The mechanism behind the regression: MuonClip's step is the same for a gradient and for that gradient times
    1e-6, so a step on noise is as large as a step on signal."""
    cfg = load_rl_config(CONFIG, MICRO + ["warmup.steps=0"])
    steps = []
    for scale in (1.0, 1e-6):
        torch.manual_seed(0)
        policy = K2ForCausalLM(cfg.model)
        optimizer = build_rl_optimizer(policy, cfg.optim)
        start = _weights(policy)
        torch.manual_seed(1)
        for q in policy.parameters():
            q.grad = torch.randn_like(q) * scale
        optimizer.step(None)
        steps.append([b - a for a, b in zip(start, _weights(policy), strict=True)])
    norms = [[float(d.norm()) for d in step if d.dim() == 2] for step in steps]
    ratios = [tiny / big for big, tiny in zip(*norms, strict=True) if big > 0]
    assert ratios and min(ratios) > 0.5  # a million times smaller gradient, (nearly) the same step


def test_groups_with_reward_signal_train(tmp_path):
    cfg = load_rl_config(CONFIG, MICRO + ["warmup.steps=0"])
    trainer = RLTrainer(cfg, tmp_path)
    groups = _finished_groups(trainer)
    trainer.envs[0].task = _FirstSampleRight(informative=True)
    before = _weights(trainer.policy)
    record = trainer._train(groups)
    assert record["groups_informative"] == 3 and record["updates"] == 1
    assert record["log_ratio_abs"] < 2e-3  # pi_theta == pi_old before the first update
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(trainer.policy), strict=True))
