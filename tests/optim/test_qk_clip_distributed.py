"""QK-Clip in data-parallel runs: max logits are MAX-reduced across real gloo processes before clipping."""

import torch

from openk2.optim.qk_clip import QKClip
from tests.train.parallel.ranks import run_ranks


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = 2, 3
        self.q_proj = torch.nn.Linear(4, 6, bias=False)
        self.k_proj = torch.nn.Linear(4, 6, bias=False)
        torch.nn.init.ones_(self.q_proj.weight)
        torch.nn.init.ones_(self.k_proj.weight)


def _worker(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank of the 2-process gloo group (run_ranks has joined it): its clip factors and clipped q weight."""
    layer = _Head()
    # Each rank saw a different batch: rank 0's head 0 exceeded tau, rank 1's head 1 did.
    local = torch.tensor([[200.0, 50.0]]) if rank == 0 else torch.tensor([[20.0, 400.0]])
    gamma = QKClip(attention_layers=[layer], tau=100.0).apply(local)
    return gamma, layer.q_proj.weight.detach().clone()


def test_max_logits_are_max_reduced_across_ranks():
    results = run_ranks(2, _worker)
    expected = torch.tensor([[100 / 200, 100 / 400]])
    for rank in (0, 1):
        gamma, q_weight = results[rank]
        torch.testing.assert_close(gamma, expected)
    torch.testing.assert_close(results[0][1], results[1][1])  # every rank applies the same clip
