"""`run_ranks` (ranks.py): each rank is its own process in one gloo group, sees the caller's current environment,
working directory and output as `mp.spawn` gave it, and a rank's exception fails the caller."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.train.parallel.ranks import run_ranks


def _report(rank: int) -> dict:
    print(f"rank {rank} writes to the test's output", flush=True)
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    return {"pid": os.getpid(), "rank": dist.get_rank(), "world": dist.get_world_size(), "sum": int(total),
            "env": os.environ.get("OPENK2_RANKS_PROBE"), "cwd": os.getcwd(), "threads": torch.get_num_threads()}


def _fail(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")


def test_ranks_are_separate_processes_with_the_callers_environment(tmp_path, monkeypatch, capfd):
    with capfd.disabled():  # the forkserver runs before the environment, directory and output change
        run_ranks(1, _report)
    monkeypatch.setenv("OPENK2_RANKS_PROBE", "set-by-the-test")
    monkeypatch.chdir(tmp_path)
    out = run_ranks(3, _report)
    assert sorted(out) == [0, 1, 2]
    assert len({r["pid"] for r in out.values()} | {os.getpid()}) == 4  # three new processes
    for rank, r in out.items():
        assert (r["rank"], r["world"], r["sum"]) == (rank, 3, 6)  # one group: the all-reduce saw every rank
        assert r["env"] == "set-by-the-test" and r["cwd"] == str(tmp_path) and r["threads"] == 1
    printed = capfd.readouterr().out
    assert all(f"rank {rank} writes to the test's output" in printed for rank in range(3)), printed


def test_an_exception_in_a_rank_fails_the_caller():
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 failed on purpose"):
        run_ranks(2, _fail)
