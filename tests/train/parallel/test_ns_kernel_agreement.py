"""Every rank of a parallel run uses rank 0's Newton-Schulz kernel choice, whatever its own timing says."""

from __future__ import annotations

import torch

from openk2.optim.ns_kernel import clear_ns_kernel_cache, pin_ns_kernel, select_ns_kernel
from openk2.train.parallel.zero import agree_ns_kernel
from tests.train.parallel.ranks import run_ranks

CPU = torch.device("cpu")


def _agree(rank: int) -> tuple[str, str]:
    # Each rank starts from a different "measurement": rank 0 found fp32 fastest, rank 1 native.
    pin_ns_kernel(CPU, torch.bfloat16, "fp32" if rank == 0 else "native")
    agreed = agree_ns_kernel(CPU, torch.bfloat16)
    return agreed, select_ns_kernel(CPU, torch.bfloat16)


def test_ranks_pin_rank_zeros_choice():
    out = run_ranks(2, _agree)
    assert out == {0: ("fp32", "fp32"), 1: ("fp32", "fp32")}


def test_single_process_keeps_its_own_measurement():
    clear_ns_kernel_cache()
    try:
        pin_ns_kernel(CPU, torch.bfloat16, "emulated")
        assert agree_ns_kernel(CPU, torch.bfloat16) == "emulated"
    finally:
        clear_ns_kernel_cache()
