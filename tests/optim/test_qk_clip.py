"""QK-Clip on a real K2ForCausalLM: logits of clipped heads scale by exactly gamma, everything else untouched."""

import pytest
import torch
from torch import nn

from openk2 import K2ForCausalLM
from openk2.model import ForwardStats
from openk2.optim.qk_clip import QKClip

from ..model.conftest import small_config


def _layer_inputs(model, ids):
    """Each attention layer's (normalised) input for `ids`, with the rope tables."""
    hidden, inputs = model.model.embed_tokens(ids), []
    b, t = ids.shape
    cos, sin = model.model.rotary_emb(torch.arange(t).expand(b, t))
    for layer in model.model.layers:
        inputs.append(layer.input_layernorm(hidden))
        hidden = layer(hidden, cos, sin)
    return inputs, cos, sin


def _layer_logits(model, inputs, cos, sin):
    """Scaled, causally masked pre-softmax logits [L, B, H, T, T] of every layer on fixed per-layer inputs.

    Clipping a layer changes what later layers see, so the invariant is checked layer by layer on the inputs
    each layer had when its max logit was recorded."""
    out = []
    for layer, x in zip(model.model.layers, inputs, strict=True):
        q, k, _ = layer.self_attn.qkv(x, cos, sin)
        t = x.shape[1]
        logits = (q @ k.transpose(-1, -2)) * layer.self_attn.scale
        out.append(logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")))
    return torch.stack(out)


@torch.no_grad()
def test_qk_clip_invariant_on_mla():
    torch.manual_seed(0)
    model = K2ForCausalLM(small_config(initializer_range=0.1)).eval()
    attn0 = model.model.layers[0].self_attn
    qk, nv = attn0.nope_dim + attn0.rope_dim, attn0.nope_dim + attn0.v_dim
    # Inflate head 1 of layer 0 and head 3 of layer 2 so their logits exceed tau.
    for layer, head in ((0, 1), (2, 3)):
        attn = model.model.layers[layer].self_attn
        attn.q_b_proj.weight[head * qk:(head + 1) * qk] *= 40
        attn.kv_b_proj.weight[head * nv:head * nv + attn.nope_dim] *= 40
    ids = torch.randint(0, 97, (2, 24))
    stats = ForwardStats(model.config, track_max_logits=True)
    model(ids, stats=stats)
    before_max = stats.max_logits()
    tau = 3.0
    assert before_max[0, 1] > tau and before_max[2, 3] > tau
    inputs, cos, sin = _layer_inputs(model, ids)
    before_logits = _layer_logits(model, inputs, cos, sin)
    torch.testing.assert_close(before_logits.amax(dim=(1, 3, 4)), before_max)
    before_state = {k: v.clone() for k, v in model.state_dict().items()}

    gamma = QKClip(model, tau=tau).apply(before_max)

    clipped = before_max > tau
    torch.testing.assert_close(gamma[clipped], tau / before_max[clipped])
    assert (gamma[~clipped] == 1).all()
    after_logits = _layer_logits(model, inputs, cos, sin)
    assert (after_logits.amax(dim=(1, 3, 4)) <= tau * (1 + 1e-4)).all()
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    for l_idx in range(3):
        for h in range(4):  # every head's logits are exactly gamma_h times the old ones (gamma = 1: unchanged)
            torch.testing.assert_close(after_logits[l_idx, :, h][..., causal],
                                       gamma[l_idx, h] * before_logits[l_idx, :, h][..., causal],
                                       rtol=1e-5, atol=1e-5)
    # Bit-identical: other heads' rows, V rows, the shared rope key, q_a_proj, norms.
    state = model.state_dict()
    for name, value in state.items():
        if name.endswith(("q_b_proj.weight", "kv_b_proj.weight")):
            continue
        assert torch.equal(value, before_state[name]), name
    for l_idx, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q_w = attn.q_b_proj.weight.view(4, qk, -1)
        kv_w = attn.kv_b_proj.weight.view(4, nv, -1)
        q_old = before_state[f"model.layers.{l_idx}.self_attn.q_b_proj.weight"].view(4, qk, -1)
        kv_old = before_state[f"model.layers.{l_idx}.self_attn.kv_b_proj.weight"].view(4, nv, -1)
        for h in range(4):
            g = gamma[l_idx, h]
            if g == 1:
                assert torch.equal(q_w[h], q_old[h]) and torch.equal(kv_w[h], kv_old[h])
            else:
                torch.testing.assert_close(q_w[h, :attn.nope_dim], q_old[h, :attn.nope_dim] * g.sqrt())
                torch.testing.assert_close(q_w[h, attn.nope_dim:], q_old[h, attn.nope_dim:] * g)
                torch.testing.assert_close(kv_w[h, :attn.nope_dim], kv_old[h, :attn.nope_dim] * g.sqrt())
                assert torch.equal(kv_w[h, attn.nope_dim:], kv_old[h, attn.nope_dim:])  # V rows


@torch.no_grad()
def test_qk_clip_without_q_lora_uses_q_proj():
    torch.manual_seed(0)
    model = K2ForCausalLM(small_config(q_lora_rank=None, initializer_range=0.5))
    stats = ForwardStats(model.config, track_max_logits=True)
    ids = torch.randint(0, 97, (1, 16))
    model(ids, stats=stats)
    before = stats.max_logits()
    inputs, cos, sin = _layer_inputs(model, ids)
    tau = float(before.median())
    QKClip(model, tau=tau).apply(before)
    after = _layer_logits(model, inputs, cos, sin).amax(dim=(1, 3, 4))
    assert (after <= tau * (1 + 1e-4)).all()
    torch.testing.assert_close(after, torch.minimum(before, torch.tensor(tau)), rtol=1e-5, atol=1e-5)


class _MHA(nn.Module):
    def __init__(self, num_heads, num_kv, head_dim=4, dim=12):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = num_heads, num_kv, head_dim
        self.q_proj = nn.Linear(dim, num_heads * head_dim)
        self.k_proj = nn.Linear(dim, num_kv * head_dim)

    def logits(self, x):
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(-1, self.num_key_value_heads, self.head_dim)
        k = k.repeat_interleave(self.num_heads // self.num_key_value_heads, dim=1)
        return torch.einsum("thd,shd->hts", q, k)


@pytest.mark.parametrize("num_kv", [4, 2])
@torch.no_grad()
def test_qk_clip_mha_and_gqa(num_kv):
    torch.manual_seed(0)
    attn = _MHA(4, num_kv)
    x = torch.randn(10, 12)
    before = attn.logits(x)
    max_logits = before.amax(dim=(1, 2))[None]
    tau = float(max_logits.min()) * 1.01
    gamma = QKClip(attention_layers=[attn], tau=tau).apply(max_logits)[0]
    after = attn.logits(x)
    torch.testing.assert_close(after, before * gamma[:, None, None], rtol=1e-5, atol=1e-6)


def test_bad_inputs():
    with pytest.raises(ValueError, match="tau"):
        QKClip(attention_layers=[], tau=0)
    with pytest.raises(ValueError, match="neither MLA"):
        QKClip(attention_layers=[nn.Linear(2, 2)])
    model = K2ForCausalLM(small_config())
    with pytest.raises(ValueError, match="layers"):
        QKClip(model).apply(torch.ones(5, 4))
