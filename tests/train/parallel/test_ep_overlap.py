"""EP overlap (`parallel.ep_overlap`, train/parallel/expert.py) on real gloo processes: the shared expert runs
between the dispatch all-to-all's issue and its wait, in forward and in backward, and training with overlap
equals training without it bit for bit (the same ops on the same values, only the waits move).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.train.parallel.ranks import run_ranks
from tests.train.parallel.runs import micro_run, records

TOKENS = 24  # per rank
STEPS = 3
AUX = 0.05  # sequence-wise balance loss weight: the aux loss's gradient crosses the exchanges too


def _layer(overlap: bool | None, rank: int, events: list[str] | None = None):
    """A MoE layer (8 experts, top-2, aux loss on), the same on every rank; with this ep rank's half of the
    experts unless `overlap` is None (the single-device layer)."""
    import torch.distributed as dist

    from openk2.model.moe import MoE
    from openk2.train.parallel.expert import ExpertParallelExperts

    torch.manual_seed(0)
    moe = MoE(_config(), 1)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if overlap is not None:
        moe.experts = ExpertParallelExperts(moe.experts, dist.group.WORLD, rank, 2, overlap)
    if events is not None:
        def pre_hook(module, args):
            events.append("shared")

        def hook(module, args, out):
            out.register_hook(lambda grad: events.append("shared-backward-starts"))

        moe.shared_experts.register_forward_pre_hook(pre_hook)
        moe.shared_experts.register_forward_hook(hook)
        moe.shared_experts.register_full_backward_hook(lambda m, gi, go: events.append("shared-backward-ends"))
    return moe


def _config():
    from openk2.config import ModelConfig

    return dataclasses.replace(ModelConfig.preset("tiny"), hidden_size=32, moe_intermediate_size=16,
                               n_routed_experts=8, num_experts_per_tok=2, aux_loss_alpha=0.05, num_hidden_layers=2)


def _step(moe, rank: int) -> dict[str, torch.Tensor]:
    """Forward and backward of this rank's tokens (balance loss included); outputs and gradients."""
    from openk2.model import ForwardStats

    torch.manual_seed(100 + rank)  # each rank its own tokens
    x = torch.randn(2, TOKENS // 2, 32, requires_grad=True)
    stats = ForwardStats(_config())
    moe.train()
    y = moe(x, stats)
    aux = stats.aux_loss()
    assert aux is not None and aux > 0
    ((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + aux).backward()
    return {"y": y.detach(), "x.grad": x.grad, **{n: p.grad.clone() for n, p in moe.named_parameters()}}


def _layer_job(rank: int) -> dict:
    """One MoE layer's step with overlap on and off (exchanges and shared expert recorded in order), and
    without expert parallelism."""
    import openk2.train.parallel.expert as expert

    events: list[str] = []
    issue = expert.issue_all_to_all

    class RecordedWork:
        def __init__(self, work):
            self.work = work

        def wait(self):
            events.append("wait")
            return self.work.wait()

    def recorded_issue(*args, **kwargs):
        events.append("issue")
        return RecordedWork(issue(*args, **kwargs))

    expert.issue_all_to_all = recorded_issue
    result = {}
    try:
        for overlap in (True, False):
            events.clear()
            result[overlap] = _step(_layer(overlap, rank, events), rank)
            result[f"events-{overlap}"] = list(events)
    finally:
        expert.issue_all_to_all = issue
    result[None] = _step(_layer(None, rank), rank)
    return result


def _job(rank: int, raws: list[dict]) -> dict:
    """The layer checks, then the training runs (one set of processes: start-up is the slow part); per run this
    rank's final weights and its experts modules' overlap flags."""
    import openk2.train.trainer
    from openk2.train.config import RunConfig
    from openk2.train.parallel.expert import ExpertParallelExperts
    from openk2.train.parallel.trainer import ParallelTrainer

    result = _layer_job(rank)
    openk2.train.trainer.plot_run = lambda run_dir: []  # plots are not under test and cost seconds
    for raw in raws:
        trainer = ParallelTrainer(RunConfig.from_dict(raw))
        trainer.run()
        result[raw["out_dir"]] = {
            "flags": {m.overlap for m in trainer.model.modules() if isinstance(m, ExpertParallelExperts)},
            "weights": {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}}
    return result


@pytest.fixture(scope="module")
def ep2_runs(tmp_path_factory, micro_tokenizer_dir) -> dict:
    """Per rank the layer results and the ep2 training runs with overlap on and off; their run directories."""
    root = tmp_path_factory.mktemp("ep-overlap")
    raws = []
    for overlap in (True, False):
        raw = micro_run(micro_tokenizer_dir, root / f"overlap-{overlap}", {"ep": 2, "ep_overlap": overlap}, 2, 1,
                        STEPS)
        raw["model"]["aux_loss_alpha"] = AUX
        raw["train"].update(eval_every=100, checkpoint_every=100)  # weights compared in memory, per rank
        raws.append(raw)
    out = run_ranks(2, _job, raws)
    out["dirs"] = {overlap: Path(raw["out_dir"]) for overlap, raw in zip((True, False), raws, strict=True)}
    return out


@pytest.fixture(scope="module")
def layer_runs(ep2_runs) -> dict:
    return ep2_runs


def test_shared_expert_runs_while_the_dispatch_is_in_flight(layer_runs):
    forward = ["issue", "shared", "wait", "issue", "wait"]  # dispatch issued, shared expert, dispatch waited, combine
    backward = ["issue", "wait",  # reverse combine: nothing independent to run meanwhile
                "issue", "shared-backward-starts", "shared-backward-ends", "wait"]  # reverse dispatch
    for rank in (0, 1):
        assert layer_runs[rank]["events-True"] == forward + backward
        # Without overlap each wait follows its issue at once (what the test above would catch).
        assert layer_runs[rank]["events-False"] == ["issue", "wait", "issue", "wait", "shared",
                                                    "shared-backward-starts", "shared-backward-ends",
                                                    "issue", "wait", "issue", "wait"]


def test_overlap_gives_bit_identical_outputs_and_gradients(layer_runs):
    for rank in (0, 1):
        on, off = layer_runs[rank][True], layer_runs[rank][False]
        assert on.keys() == off.keys()
        for name, value in off.items():
            assert torch.equal(on[name], value), name
        assert off["experts.gate_proj"].abs().sum() > 0 and off["gate.weight"].abs().sum() > 0
        single = layer_runs[rank][None]  # and both are the single-device layer on this rank's tokens
        torch.testing.assert_close(on["y"], single["y"], rtol=0, atol=1e-6)
        torch.testing.assert_close(on["x.grad"], single["x.grad"], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_ep2_training_with_overlap_equals_without_bit_for_bit(ep2_runs):
    """3 steps of a 4-layer micro MoE, aux loss on, QK-Clip firing every step: losses and weights equal exactly."""
    on, off = (records(ep2_runs["dirs"][overlap]) for overlap in (True, False))
    assert sorted(on) == sorted(off) == list(range(1, STEPS + 1))
    for step in off:
        for key in ("loss", "clipped_heads", "expert_load", "tokens", "grad_norm"):
            assert on[step][key] == off[step][key], (step, key)
        assert off[step]["clipped_heads"] > 0
    for rank in (0, 1):  # each rank's dense weights and its own experts
        run_on, run_off = (ep2_runs[rank][str(ep2_runs["dirs"][overlap])] for overlap in (True, False))
        assert run_on["flags"] == {True} and run_off["flags"] == {False}  # the switch reached every MoE layer
        assert run_on["weights"].keys() == run_off["weights"].keys()
        for name, value in run_off["weights"].items():
            assert torch.equal(run_on["weights"][name], value), name
