"""The full mesh: pp2 x ep2 x dp2 on 8 real gloo processes equals the single-process run of the same batch.

Layout: 2 pipeline ranks (4 stages, interleaved 1F1B over 2 micro-batches), 2 expert ranks, 2 data-parallel
replicas, so every axis and every replication group ("data" = dp x ep for dense weights, "dp" for experts)
carries traffic at once. 4 data ranks x batch_size 1 x grad_accum 2 = the single-process batch of 8 rows
(grad_accum 1 there, see trainer.py on loss normalisation). QK-Clip at tau = 0.04 clips heads every step, from
max logits MAX-reduced over all 8 ranks. Tolerance as test_parallel_trainer.py: losses rel 1e-5, weights abs
1e-5 after 3 steps (measured: 5.0e-6 in one embedding element, an AdamW entry whose gradient is ~0, where
Adam's g / sqrt(v) amplifies summation-order noise; every other tensor within 1.2e-7).
"""

from __future__ import annotations

import pytest

from openk2.train.config import RunConfig
from openk2.train.trainer import Trainer
from tests.train.parallel.ranks import run_ranks
from tests.train.parallel.runs import assert_same_run, micro_run, records

STEPS = 3
MESH = {"pp": 2, "ep": 2, "dp": 2, "pp_virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}


def _train(rank: int, raw: dict) -> None:
    import openk2.train.trainer
    from openk2.train.parallel.trainer import ParallelTrainer

    openk2.train.trainer.plot_run = lambda run_dir: []  # plots are not under test and cost seconds
    ParallelTrainer(RunConfig.from_dict(raw)).run()


@pytest.mark.slow
def test_pp2_ep2_dp2_on_8_ranks_matches_single_process(tmp_path, micro_tokenizer_dir, monkeypatch):
    monkeypatch.setattr("openk2.train.trainer.plot_run", lambda run_dir: [])
    single, mesh = tmp_path / "single", tmp_path / "pp2-ep2-dp2"
    Trainer(RunConfig.from_dict(micro_run(micro_tokenizer_dir, single, {}, 8, 1, STEPS))).run()
    run_ranks(8, _train, micro_run(micro_tokenizer_dir, mesh, MESH, 1, 2, STEPS))
    worst = assert_same_run(mesh, single, STEPS)
    print(f"pp2 x ep2 x dp2: largest weight difference after {STEPS} steps {worst:.2e}")
    for record in records(mesh).values():  # per-device throughput: global tokens/s over the 8 devices
        assert record["tokens_per_s_per_device"] == pytest.approx(record["tokens_per_s"] / 8)
        assert 0 < record["comm_s"] < record["step_s"] and record["comm_share"] == pytest.approx(
            record["comm_s"] / record["step_s"])
