"""QK-Clip in data-parallel runs: max logits are MAX-reduced across real gloo processes before clipping."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from openk2.optim.qk_clip import QKClip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = 2, 3
        self.q_proj = torch.nn.Linear(4, 6, bias=False)
        self.k_proj = torch.nn.Linear(4, 6, bias=False)
        torch.nn.init.ones_(self.q_proj.weight)
        torch.nn.init.ones_(self.k_proj.weight)


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        layer = _Head()
        # Each rank saw a different batch: rank 0's head 0 exceeded tau, rank 1's head 1 did.
        local = torch.tensor([[200.0, 50.0]]) if rank == 0 else torch.tensor([[20.0, 400.0]])
        gamma = QKClip(attention_layers=[layer], tau=100.0).apply(local)
        out[rank] = (gamma, layer.q_proj.weight.detach().clone())
    finally:
        dist.destroy_process_group()


def test_max_logits_are_max_reduced_across_ranks():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
        results = dict(out)
    expected = torch.tensor([[100 / 200, 100 / 400]])
    for rank in (0, 1):
        gamma, q_weight = results[rank]
        torch.testing.assert_close(gamma, expected)
    torch.testing.assert_close(results[0][1], results[1][1])  # every rank applies the same clip
