"""Regional compile: compiled decoder blocks give the eager model's loss and gradients, at two lengths."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from openk2.model import K2ForCausalLM
from openk2.model.compile import compile_blocks, compile_seconds
from tests.model.conftest import small_config

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="inductor on CPU compiles C++ kernels and needs a C compiler")


def _loss_and_grads(model: K2ForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training forward/backward: the loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_compiled_blocks_match_eager_at_two_sequence_lengths():
    """fp32 loss and gradients of the compiled model equal eager's to fp32 rounding; names are unchanged."""
    torch.manual_seed(0)
    cfg = small_config(num_hidden_layers=2, first_k_dense_replace=1, rope_scaling=None)
    eager = K2ForCausalLM(cfg).train()
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled) == 2
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    gen = torch.Generator().manual_seed(1)
    before = compile_seconds()
    for seq_len in (24, 40):  # dynamic=True: the second length reuses the graph instead of recompiling
        ids = torch.randint(0, cfg.vocab_size, (2, seq_len), generator=gen)
        loss_e, grads_e = _loss_and_grads(eager, ids)
        loss_c, grads_c = _loss_and_grads(compiled, ids)
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
        assert grads_c.keys() == grads_e.keys()
        for name, grad in grads_e.items():
            torch.testing.assert_close(grads_c[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    if before is not None:
        assert compile_seconds() > before  # the warm-up was measured (and really compiled something)


def test_compile_blocks_rejects_a_model_without_blocks():
    """A module with no DecoderLayer is a ValueError, not a silent no-op."""
    with pytest.raises(ValueError, match="no DecoderLayer"):
        compile_blocks(torch.nn.Linear(4, 4))
