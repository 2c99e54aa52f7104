"""FSDP2's per-rank state bytes (held.py, from storages after a real backward) against `openk2 plan`, Newton-Schulz
once per matrix across the ranks, and the layouts fsdp2 refuses.

The micro model (4 layers, 8 experts, fp32) at dp = 2 on real gloo processes: parameters and gradients are
DTensor shards in storages FSDP2 pads to rank 0's row count, so they equal the plan exactly on every rank; the
Muon momentum and AdamW moments cover the unpadded local rows, so the plan (rank 0's, the largest) bounds
every rank's optimizer bytes from above and equals rank 0's.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from openk2.config import ModelConfig
from openk2.train.config import RunConfig
from openk2.train.parallel.config import ParallelConfig
from openk2.train.parallel.held import measure_states
from openk2.train.parallel.plan import plan
from tests.train.conftest import MICRO_MODEL
from tests.train.parallel.ranks import run_ranks

MODEL = {**MICRO_MODEL, "num_hidden_layers": 4}
DP = 2
STEP_COUNTERS = 1024  # AdamW's 0-d step counters, 4 B per parameter tensor (< 256 of them)


def _config() -> ModelConfig:
    return ModelConfig.preset("tiny").replace(**{k: v for k, v in MODEL.items() if k != "preset"})


def _measure_and_count(rank: int, parallel: dict) -> dict:
    """held_state_bytes after one backward, and then the matrices this rank orthogonalises in one step."""
    import openk2.train.parallel.fsdp_muonclip as fsdp_muonclip
    from openk2.train.parallel.held import held_state_bytes
    from openk2.train.parallel.mesh import init_parallel

    held = measure_states(_config(), ParallelConfig(**parallel), torch.device("cpu"), rows=2)
    from openk2.train.parallel.fsdp import build_fsdp_model

    mesh = init_parallel(ParallelConfig(**parallel), torch.device("cpu"))
    model = build_fsdp_model(_config(), mesh, torch.device("cpu"), init_seed=0)
    optimizer = fsdp_muonclip.build_fsdp_optimizer(model, mesh, {"lr": 1e-3, "ns_dtype": torch.float32})
    ids = torch.randint(0, _config().vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(ids, labels=ids).loss.backward()
    counted: list[int] = []
    real = fsdp_muonclip.zeropower_via_newtonschulz5
    fsdp_muonclip.zeropower_via_newtonschulz5 = lambda x, *a: counted.append(x.shape[0]) or real(x, *a)
    optimizer.step()
    return {"held": held, "orthogonalised": sum(counted), "bytes": held_state_bytes(model, optimizer)}


def _muon_matrices() -> int:
    """Matrices single-process Muon orthogonalises per step (a 3-D expert stack counts each expert)."""
    from openk2.model import K2ForCausalLM
    from openk2.optim.param_groups import default_muon_filter

    with torch.device("meta"):
        model = K2ForCausalLM(_config())
    return sum(p.shape[0] if p.ndim == 3 else 1 for n, p in model.named_parameters() if default_muon_filter(n, p))


@pytest.mark.slow
def test_fsdp2_states_per_rank_equal_the_plan_and_each_matrix_is_orthogonalised_once():
    parallel = {"dp": DP, "shard": "fsdp2"}
    measured = run_ranks(DP, _measure_and_count, parallel)
    planned = plan(RunConfig.from_dict({"model": dict(MODEL), "parallel": parallel}), device_type="cpu")["per_rank"]
    single = measure_states(_config(), ParallelConfig(), torch.device("cpu"))
    unsharded = single["total"] - single["master"]
    for row in planned:
        got = measured[row["rank"]]["held"]
        assert got["params"] == row["params_bytes"] == single["params"] // DP
        assert got["grads"] == row["grads_bytes"] == single["grads"] // DP
        assert got["master"] == row["master_bytes"] == 0
        assert got["optimizer"] <= row["optimizer_bytes"]
        # 1/dp of fp32 MuonClip's weights, gradients, momentum and moments (the one-process trainer's ZeRO-1
        # also keeps fp32 AdamW masters, left out here); AdamW step counters (4 B each) are not sharded.
        assert unsharded / DP - STEP_COUNTERS <= got["total"] <= unsharded / DP
        assert measured[row["rank"]]["bytes"] == got  # the step allocates no lasting state
    assert measured[0]["held"]["optimizer"] == planned[0]["optimizer_bytes"]
    assert sum(m["orthogonalised"] for m in measured.values()) == _muon_matrices()


def test_fsdp2_refuses_what_it_does_not_run():
    for schedule in ("interleaved_zero_bubble", "zbv_zero_bubble"):
        with pytest.raises(ValueError, match="parallel.shard=fsdp2 with pp > 1 runs schedules with a whole backward"):
            ParallelConfig(dp=2, pp=2, pp_virtual_stages=2, pp_schedule=schedule, shard="fsdp2")
    assert ParallelConfig(dp=2, ep=2, shard="fsdp2").world_size == 4  # ep > 1 runs (test_fsdp_ep.py)
    assert ParallelConfig(dp=2, pp=2, shard="fsdp2").world_size == 4  # pp > 1 too (test_fsdp_ep_pp.py)
    with pytest.raises(ValueError, match="parallel.shard=fsdp2 with pp > 1 needs dp x ep > 1"):
        ParallelConfig(pp=2, shard="fsdp2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dp = 1, ep = 2: the dense weights are still sharded over the ep ranks
        ParallelConfig(ep=2, shard="fsdp2")
    with pytest.raises(ValueError, match="parallel.shard must be one of"):
        ParallelConfig(shard="zero3")
    with pytest.warns(UserWarning, match="nothing to shard"):
        ParallelConfig(shard="fsdp2")


def test_fsdp2_plan_shards_states_over_dp():
    """The plan's fsdp2 states fall as 1/dp (the micro model's tensors divide evenly) and sit below ZeRO-1's."""
    def worst(parallel: dict) -> dict:
        return plan(RunConfig.from_dict({"model": dict(MODEL), "parallel": parallel}), device_type="cpu")["per_rank"][0]
    zero1 = worst({"dp": 2})
    dp2, dp4, dp8 = (worst({"dp": dp, "shard": "fsdp2"}) for dp in (2, 4, 8))
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert dp2[key] == 2 * dp4[key] == 4 * dp8[key]
    assert dp2["params_bytes"] == zero1["params_bytes"] // 2
    assert dp2["params_bytes"] + dp2["grads_bytes"] + dp2["optimizer_bytes"] < \
        zero1["params_bytes"] + zero1["grads_bytes"] + zero1["master_bytes"] + zero1["optimizer_bytes"]
