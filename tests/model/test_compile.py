"""Regional compile: compiled decoder blocks give the eager model's loss and gradients, at two lengths (fp32),
and in bf16 with the short attention traced into the blocks."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from openk2.model import K2ForCausalLM
from openk2.model.compile import compile_blocks, compile_seconds
from tests.model.conftest import randomise_extras, small_config

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="inductor on CPU compiles C++ kernels and needs a C compiler")


def _loss_and_grads(model: K2ForCausalLM, ids: torch.Tensor,
                    **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training forward/backward: the loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, **kwargs).loss
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


def _graph_code(gm: torch.fx.GraphModule) -> str:
    """The Python code of a captured graph and of every subgraph in it (autograd.Function bodies)."""
    return "\n".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))


def _worst_relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest max|got - want| / max|want| over the tensors, and whose it is."""
    errors = {n: ((got[n].float() - w.float()).abs().max() / w.float().abs().max()).item() for n, w in want.items()}
    name = max(errors, key=errors.get)
    return errors[name], name


@pytest.mark.slow
def test_compiled_short_attention_matches_eager_in_bf16():
    """bf16 on CPU: blocks compiled with short_attention on give eager's loss and gradients within bf16 rounding.

    Routes are pinned (eager records, the others replay: routing.py) so that a near-tie token the two
    roundings send to different experts does not stand in for a kernel error; an fp32 model with the same
    routes is the reference both are measured against."""
    from openk2.model.routing import RoutingTrace

    torch.manual_seed(0)
    # One MoE block: a compiled graph per block, and each costs inductor ~30 s on a cold cache.
    cfg = small_config(num_hidden_layers=1, first_k_dense_replace=0, rope_scaling=None)
    reference = K2ForCausalLM(cfg).train()
    randomise_extras(reference)
    eager = copy.deepcopy(reference).to(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)

    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    cos, sin = eager.model.rotary_emb(torch.arange(40)[None].expand(2, -1))
    x = torch.randn(2, 40, cfg.hidden_size, dtype=torch.bfloat16)
    explained = torch._dynamo.explain(copy.deepcopy(eager.model.layers[0]))(x, cos, sin)
    assert explained.graph_break_count == 0
    code = _graph_code(explained.graphs[0])
    assert "baddbmm" in code and "scaled_dot_product_attention" not in code  # short_attention was traced

    trace = RoutingTrace(cfg)
    results = {"eager": _loss_and_grads(eager, ids, routing=trace)}
    routes = trace.used()
    results["compiled"] = _loss_and_grads(compiled, ids, routing=RoutingTrace(cfg, replay=routes))
    results["fp32"] = _loss_and_grads(reference, ids, routing=RoutingTrace(cfg, replay=routes))
    (loss_e, grads_e), (loss_c, grads_c), (loss_r, grads_r) = results.values()
    torch.testing.assert_close(loss_c, loss_e, rtol=3e-4, atol=0.0)
    assert grads_c.keys() == grads_e.keys() == grads_r.keys()
    compiled_vs_eager, name = _worst_relative(grads_c, grads_e)
    eager_error, _ = _worst_relative(grads_e, grads_r)
    compiled_error, name_r = _worst_relative(grads_c, grads_r)
    assert compiled_vs_eager <= 4e-2, f"{name}: compiled differs from eager by {compiled_vs_eager:.1e} of its max"
    # Compiling may round differently, not worse: its error against fp32 stays near eager's own.
    assert compiled_error <= 2 * eager_error, f"{name_r}: {compiled_error:.1e} vs eager's {eager_error:.1e}"


def test_every_block_of_a_deep_model_is_compiled():
    """Each block compiles its own graph under one shared code object (dynamo guards on its layer index), so past
    dynamo's recompile limit (8 by default; 2 here, to keep the test small) the later blocks used to run eagerly:
    12 blocks gave 8 graphs, and these 4 gave 2."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    cfg = small_config(num_hidden_layers=4, first_k_dense_replace=1, rope_scaling=None)
    model = K2ForCausalLM(cfg).train().to(torch.bfloat16)  # bf16: grouped_mm traces, one graph per block
    counter = CompileCounter()  # dynamo's graph counter as the backend: no inductor, fast
    with torch._dynamo.config.patch(recompile_limit=2, accumulated_recompile_limit=256):
        assert compile_blocks(model, backend=counter) == 4
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        model(ids, labels=ids).loss.backward()
    assert counter.frame_count == 4
