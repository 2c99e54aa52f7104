"""ForwardStats, the caller-owned collector: what one forward reports vs what a collector spanning several holds,
and the InnerAttention seam the engine plugs into the model's own layers."""

import torch

from openk2 import K2ForCausalLM
from openk2.model import ForwardStats

from .conftest import small_config


def _model(**overrides) -> K2ForCausalLM:
    torch.manual_seed(0)
    return K2ForCausalLM(small_config(initializer_range=0.1, **overrides))


def test_output_covers_one_call_and_the_collector_accumulates():
    model = _model(aux_loss_alpha=0.01).train()
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    stats = ForwardStats(model.config, track_max_logits=True)
    first = model(ids[:1], labels=ids[:1], stats=stats)
    second = model(ids[1:], labels=ids[1:], stats=stats)
    alone = model(ids[1:], labels=ids[1:])  # no collector: the same output
    assert torch.equal(second.loss, alone.loss) and torch.equal(second.tokens_per_expert, alone.tokens_per_expert)
    assert torch.equal(stats.tokens_per_expert(), first.tokens_per_expert + second.tokens_per_expert)
    torch.testing.assert_close(stats.aux_loss(), (first.aux_loss + second.aux_loss).detach())
    assert first.aux_loss.requires_grad and not stats.aux_loss().requires_grad  # the collector holds no graph
    both = ForwardStats(model.config, track_max_logits=True)
    with torch.no_grad():
        model(ids, stats=both)
    torch.testing.assert_close(stats.max_logits(), both.max_logits())
    stats.reset()
    assert stats.tokens_per_expert().sum() == 0 and stats.aux_loss() is None and stats.max_logits().isinf().all()


def test_layers_record_into_their_rows_only():
    """A collector fed by some layers (a pipeline stage's) leaves the others' rows at 0 counts and -inf logits."""
    model = _model()
    cfg = model.config
    stats = ForwardStats(cfg, track_max_logits=True)
    x = torch.randn(1, 5, cfg.hidden_size)
    cos, sin = model.model.rotary_emb(torch.arange(5)[None])
    model.model.layers[2](x, cos, sin, stats=stats)  # the second MoE layer alone
    counts, max_logits = stats.tokens_per_expert(), stats.max_logits()
    assert counts.shape == (2, cfg.n_routed_experts) and max_logits.shape == (3, cfg.num_attention_heads)
    assert counts[0].sum() == 0 and counts[1].sum() == 5 * cfg.num_experts_per_tok
    assert max_logits[:2].isinf().all() and max_logits[2].isfinite().all()
    assert stats.aux_loss() is None  # aux_loss_alpha = 0
    empty = stats.empty_like()
    assert empty.track_max_logits and empty.tokens_per_expert().sum() == 0
    assert stats.tokens_per_expert()[1].sum() == 5 * cfg.num_experts_per_tok  # untouched by its copy


def test_dense_model_has_no_expert_counts():
    model = _model(first_k_dense_replace=3)
    out = model(torch.tensor([[1, 2, 3]]))
    assert out.tokens_per_expert is None and ForwardStats(model.config).tokens_per_expert() is None


def test_inner_attention_replaces_the_attention_core():
    model = _model().eval()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    calls = []

    def same_core(attn, q_nope, q_rope, latent, k_rope, cos, sin):
        calls.append(attn.layer_idx)
        return attn.sdpa(q_nope, q_rope, latent, k_rope, cos, sin)

    def no_attention(attn, q_nope, q_rope, latent, k_rope, cos, sin):
        b, _, t, _ = q_nope.shape
        return torch.zeros(b, t, attn.num_heads * attn.v_dim)

    with torch.no_grad():
        plain = model.model(ids)
        assert torch.equal(model.model(ids, inner_attention=same_core), plain)
        assert calls == [0, 1, 2]
        x = model.model.embed_tokens(ids)
        for layer in model.model.layers:  # with a zero core each block is x + mlp(norm(x)) (o_proj has no bias)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        torch.testing.assert_close(model.model(ids, inner_attention=no_attention), model.model.norm(x))
