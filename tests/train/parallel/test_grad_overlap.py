"""DP gradient reduction overlapped with backward (`parallel.overlap_grad_reduce`, train/parallel/grad_hooks.py).

On real gloo processes, overlap on equals overlap off bit for bit (losses, gradient norms, final weights): both
reduce the same buckets with the same collectives, only earlier. Covered: dp2 with a real forward/backward of
the micro model (grad_accum 2, fp32 and bf16 weights, QK-Clip firing, an idle parameter no forward reaches,
gradient clipping), and through ParallelTrainer dp2 x ep2 (dense "data" group of 4 and expert "dp" groups of
2, fp32 and bf16) and pp2 x dp2 (buckets armed for the whole pipeline step). Each overlapping run must have
issued buckets from backward hooks while other buckets still awaited gradients, so the test fails if the
overlap silently does nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from openk2.config import ModelConfig
from openk2.model import ForwardStats, K2ForCausalLM
from openk2.optim.ns_kernel import pin_ns_kernel
from openk2.train.config import RunConfig
from openk2.train.parallel.config import ParallelConfig
from openk2.train.parallel.grad_hooks import GradBuckets
from openk2.train.parallel.mixed import grad_of
from openk2.train.parallel.zero import DistributedMuonClip
from tests.train.conftest import MICRO_MODEL
from tests.train.parallel.ranks import run_ranks
from tests.train.parallel.runs import final_weights, micro_run, records

STEPS = 2
ACCUM = 2
BUCKET = 8192  # elements: the micro model (~0.2 M parameters) makes ~25 buckets
HYPER = {"lr": 0.02, "weight_decay": 0.1, "tau": 0.04, "ns_dtype": torch.float32}  # tau 0.04: clips every step


def _model() -> K2ForCausalLM:
    fields = {k: v for k, v in MICRO_MODEL.items() if k != "preset"}
    return K2ForCausalLM(ModelConfig.preset("tiny").replace(**fields), init_seed=0)


def _summed_grad_norm(params: list[nn.Parameter]) -> float:
    """The norm of the gradient summed over ranks, from copies of this rank's local gradients."""
    grads = [grad_of(p) for p in params]
    flat = torch.cat([(torch.zeros(p.numel()) if g is None else g.float().reshape(-1)) for p, g in
                      zip(params, grads, strict=True)])
    dist.all_reduce(flat)
    return float(flat.norm())


def _train_direct(rank: int, overlap: bool, dtype: torch.dtype) -> dict:
    pin_ns_kernel(torch.device("cpu"), torch.bfloat16, "emulated")
    model = _model()
    idle = nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(3)))  # no forward reaches it
    named = [("idle.weight", idle), *model.named_parameters()]  # registered first: its bucket is the last
    opt = DistributedMuonClip(model, named, dict(enumerate(model.attention_layers())), **HYPER, param_dtype=dtype,
                              overlap_grad_reduce=overlap, grad_bucket_numel=BUCKET)
    out = {"losses": [], "norms": [], "reference_norms": [], "in_backward": [], "clipped": []}
    for step in range(STEPS):
        stats = ForwardStats(model.config, track_max_logits=True)
        for micro in range(ACCUM):
            gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
            loss = model(ids, labels=ids, stats=stats).loss / ACCUM
            if micro == ACCUM - 1:
                opt.arm_overlap(1)
            before = opt.overlap_stats()
            loss.backward()
            after = opt.overlap_stats()
            out["losses"].append(float(loss))
        out["in_backward"].append((after.hook - before.hook, after.early - before.early))
        if not overlap:  # the reference norm needs the local gradients, which overlap frees during backward
            out["reference_norms"].append(_summed_grad_norm([p for _, p in named]))
        opt.reduce_gradients()
        out["norms"].append(opt.clip_grad_norm(0.05))
        out["clipped"].append(opt.step(stats.max_logits()).num_clipped)
        opt.zero_grad()
    out["drained"] = opt.overlap_stats().drain
    out["weights"] = {name: p.detach().clone() for name, p in named}
    return out


@pytest.mark.slow
def test_dp2_overlap_equals_no_overlap_bitwise_fp32_and_bf16():
    results = run_ranks(2, _run_both)
    for rank, dtype in ((r, d) for r in range(2) for d in ("fp32", "bf16")):
        off, on = results[rank][dtype]
        assert on["losses"] == off["losses"]
        assert on["norms"] == off["norms"]
        assert all(n > 0 for n in on["clipped"]) and on["clipped"] == off["clipped"]
        for name, value in off["weights"].items():
            assert torch.equal(on["weights"][name], value), f"rank {rank}: {name}"
        # clip_grad_norm: the norm of the rank-summed gradient (each reduced element counted once)
        for got, want in zip(off["norms"], off["reference_norms"], strict=True):
            assert got == pytest.approx(want, rel=1e-5)
        assert all(hook == 0 for hook, _ in off["in_backward"])
        # Issued from hooks inside backward, most of them while later buckets still awaited gradients; the
        # idle parameter's bucket (the last) waits for the drain.
        for hook, early in on["in_backward"]:
            assert hook >= 10 and early >= 10
        assert on["drained"] >= STEPS
    assert not torch.equal(results[0]["fp32"][1]["weights"]["idle.weight"],
                           torch.randn(16, 8, generator=torch.Generator().manual_seed(3)))  # decayed: it was updated


def _run_both(rank: int) -> dict[str, tuple[dict, dict]]:
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return {name: (_train_direct(rank, False, d), _train_direct(rank, True, d)) for name, d in dtypes.items()}


def test_buckets_follow_reverse_registration_order_and_cap():
    params = [nn.Parameter(torch.zeros(n)) for n in (5, 3, 4, 9, 1)]

    class Part:
        def __init__(self, ps):
            self.params = ps

    buckets = GradBuckets([Part(params[:2]), Part(params[2:])], params, None, cap=8, hooks=False)
    sizes = [[(k, i) for k, i in run] for run in buckets.buckets]
    assert sizes == [[(1, 2)], [(1, 1)], [(1, 0), (0, 1)], [(0, 0)]]  # 1, then 9 alone, 4 + 3, then 5


class _Recorder:
    """A bucket part that records which parameters each issued bucket held (no communication)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params, self.issued = params, []

    def reduce_bucket(self, indices: list[int], group) -> list:
        self.issued.append(list(indices))
        return []


def test_hooks_issue_buckets_during_backward_in_order_and_refuse_late_gradients():
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4, bias=False) for _ in range(3)]
    part = _Recorder([layer.weight for layer in layers])
    buckets = GradBuckets([part], part.params, None, cap=16, hooks=True)  # one 4x4 weight per bucket
    x = torch.randn(2, 4)

    def backward() -> None:
        layers[2](layers[1](layers[0](x))).sum().backward()

    backward()  # not armed: the hooks issue nothing
    assert part.issued == []
    buckets.drain()
    assert part.issued == [[2], [1], [0]] and buckets.stats.last == (0, 3)
    part.issued.clear()
    buckets.arm(1)
    backward()  # the last layer's weight is final first; each bucket goes out inside backward
    assert part.issued == [[2], [1], [0]] and (buckets.stats.hook, buckets.stats.early) == (3, 2)
    buckets.drain()
    assert buckets.stats.last == (3, 0)
    buckets.arm(1)
    backward()
    backward()  # a second accumulation after the buckets went out: refused, not silently dropped
    with pytest.raises(RuntimeError, match="arrived after its bucket was reduced"):
        buckets.drain()


def test_bad_bucket_size_and_fires_are_value_errors():
    with pytest.raises(ValueError, match="grad_bucket_numel"):
        ParallelConfig(grad_bucket_numel=0)
    buckets = GradBuckets([], [], None, cap=4, hooks=False)
    with pytest.raises(ValueError, match="fires"):
        buckets.arm(0)


# ------------------------------------------------------------------------------------------ through the trainer
LAYOUTS = {
    "dp2ep2-fp32": ({"dp": 2, "ep": 2}, 1),
    "dp2ep2-bf16": ({"dp": 2, "ep": 2, "param_dtype": "bfloat16"}, 1),
    "pp2dp2-fp32": ({"pp": 2, "dp": 2, "pp_virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}, 2),
}


def _trainer_runs(rank: int, jobs: list[dict]) -> list[tuple[int, int, int]]:
    import openk2.train.trainer
    from openk2.train.parallel.trainer import ParallelTrainer

    openk2.train.trainer.plot_run = lambda run_dir: []  # plots are not under test and cost seconds per run
    out = []
    for raw in jobs:
        trainer = ParallelTrainer(RunConfig.from_dict(raw))
        trainer.run()
        stats = trainer.optimizer.overlap_stats()
        out.append((stats.hook, stats.early, stats.drain))
    return out


@pytest.mark.slow
def test_trainer_overlap_equals_no_overlap_for_dp_ep_and_pipeline(tmp_path, micro_tokenizer_dir):
    jobs, names = [], []
    for name, (parallel, rows) in LAYOUTS.items():
        for overlap in (False, True):
            layout = {**parallel, "overlap_grad_reduce": overlap, "grad_bucket_numel": BUCKET}
            names.append(f"{name}-{'on' if overlap else 'off'}")
            jobs.append(micro_run(micro_tokenizer_dir, tmp_path / names[-1], layout, rows, ACCUM, STEPS))
    results = run_ranks(4, _trainer_runs, jobs)
    for name in LAYOUTS:
        off, on = records(tmp_path / f"{name}-off"), records(tmp_path / f"{name}-on")
        assert sorted(on) == sorted(off) == list(range(1, STEPS + 1))
        for step in off:
            assert on[step]["loss"] == off[step]["loss"] and on[step]["grad_norm"] == off[step]["grad_norm"], name
            assert on[step]["clipped_heads"] == off[step]["clipped_heads"] > 0
        weights = final_weights(tmp_path / f"{name}-on", STEPS)
        for key, value in final_weights(tmp_path / f"{name}-off", STEPS).items():
            assert torch.equal(weights[key], value), f"{name}: {key}"
    for rank, per_job in results.items():
        for job, (hook, early, drain) in zip(names, per_job, strict=True):
            if job.endswith("-off"):
                assert hook == early == 0, (rank, job)
            else:  # buckets went out from backward hooks, while other buckets still awaited gradients
                assert hook >= early >= STEPS, (rank, job, hook, early, drain)
