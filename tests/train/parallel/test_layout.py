"""The [parallel] section, the stage split and the rank layout (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from openk2.train.config import RunConfig
from openk2.train.parallel.config import ParallelConfig
from openk2.train.parallel.mesh import init_parallel
from openk2.train.parallel.pipeline import rank_of_stage, stage_layer_ranges, stages_of_rank


@pytest.mark.parametrize("values, message", [
    ({"dp": 0}, "parallel.dp must be at least 1"),
    ({"pp_schedule": "dualpipe"}, "parallel.pp_schedule must be one of"),
    ({"pp_schedule": "1f1b", "pp_virtual_stages": 2}, "runs one stage per rank"),
    ({"pp_schedule": "zbv_zero_bubble", "pp_virtual_stages": 3}, "exactly pp_virtual_stages=2"),
    ({"backend": "mpi"}, "parallel.backend must be one of"),
])
def test_bad_parallel_values_are_value_errors(values, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**values)


def test_parallel_section_round_trips_through_the_run_config():
    cfg = RunConfig.from_dict({"parallel": {"dp": 2, "ep": 4, "pp": 2, "pp_virtual_stages": 2}})
    assert cfg.parallel.world_size == 16 and cfg.parallel.num_stages == 4
    assert RunConfig.from_dict(cfg.to_dict()).parallel == cfg.parallel
    with pytest.raises(ValueError, match="unknown key"):
        RunConfig.from_dict({"parallel": {"tp": 2}})


def test_world_size_must_match_the_launched_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="2 ranks, but 1 were launched"):
        init_parallel(ParallelConfig(dp=2), device=torch.device("cpu"))


def test_stages_split_layers_evenly_and_reject_too_few_layers():
    assert stage_layer_ranges(61, 32)[:3] == [range(0, 2), range(2, 4), range(4, 6)]
    assert [len(r) for r in stage_layer_ranges(61, 32)] == [2] * 29 + [1] * 3
    assert [list(r) for r in stage_layer_ranges(4, 4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="smaller than parallel.pp"):
        stage_layer_ranges(3, 4)


@pytest.mark.parametrize("schedule, virtual", [("interleaved_1f1b", 2), ("looped_bfs", 3), ("zbv_zero_bubble", 2),
                                               ("1f1b", 1)])
def test_every_stage_has_exactly_one_rank(schedule, virtual):
    cfg = ParallelConfig(pp=4, pp_virtual_stages=virtual, pp_schedule=schedule)
    owners = {s: rank for rank in range(4) for s in stages_of_rank(cfg, rank)}
    assert sorted(owners) == list(range(cfg.num_stages))
    assert all(rank_of_stage(cfg, s) == rank for s, rank in owners.items())
