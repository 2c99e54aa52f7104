"""Checkpoint IO: sharding, block-FP8 dequantisation, MTP skipping, clear errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from openk2 import K2ForCausalLM
from openk2.model.io import dequantize_fp8_blocks

from .conftest import randomise_extras, small_config


def test_fp8_block_dequant_with_edge_blocks():
    torch.manual_seed(0)
    w = torch.randn(300, 200)
    scale = torch.rand(3, 2) + 0.5  # 128x128 blocks; the last row/column blocks are partial
    q = w.to(torch.float8_e4m3fn)
    out = dequantize_fp8_blocks(q, scale)
    for bi in range(3):
        for bj in range(2):
            block = (slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128))
            torch.testing.assert_close(out[block], q[block].float() * scale[bi, bj])
    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        dequantize_fp8_blocks(q, torch.ones(2, 2))


def test_sharded_save_load_round_trip(tmp_path):
    model = K2ForCausalLM(small_config())
    randomise_extras(model)
    model.save_pretrained(tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index["weight_map"]
    back = K2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_bf16_load_keeps_router_bias_fp32(tmp_path):
    model = K2ForCausalLM(small_config())
    randomise_extras(model)
    model.save_pretrained(tmp_path)
    back = K2ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert back.model.embed_tokens.weight.dtype == torch.bfloat16
    bias = back.moe_layers()[0].gate.e_score_correction_bias
    assert bias.dtype == torch.float32
    assert torch.equal(bias, model.moe_layers()[0].gate.e_score_correction_bias)


def _rewrite(path, fn):
    file = path / "model.safetensors"
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file)


def test_fp8_checkpoint_and_mtp_layers(tmp_path, capsys):
    torch.manual_seed(0)
    model = K2ForCausalLM(small_config(hidden_size=160, intermediate_size=136))
    model.save_pretrained(tmp_path)
    key = "model.layers.0.mlp.gate_proj.weight"  # [136, 160]: partial blocks in both directions
    scale = torch.tensor([[0.01, 0.02], [0.03, 0.04]])

    def quantise_and_add_mtp(t):
        t[key] = (t[key] / scale.repeat_interleave(128, 0)[:136].repeat_interleave(128, 1)[:, :160]).to(
            torch.float8_e4m3fn)
        t[key.removesuffix("weight") + "weight_scale_inv"] = scale
        t["model.layers.3.eh_proj.weight"] = torch.zeros(4, 4)  # an MTP layer after the 3 main layers
        t["model.rotary_emb.inv_freq"] = torch.zeros(2)

    _rewrite(tmp_path, quantise_and_add_mtp)
    back = K2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    w = back.model.layers[0].mlp.gate_proj.weight
    torch.testing.assert_close(w, model.model.layers[0].mlp.gate_proj.weight, rtol=0.07, atol=1e-4)
    assert "skipped 1 MTP" in capsys.readouterr().err


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    model = K2ForCausalLM(small_config())
    model.save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        K2ForCausalLM.from_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: expected \(48,\), found \(7,\)"):
        K2ForCausalLM.from_pretrained(tmp_path)


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        K2ForCausalLM.from_pretrained(tmp_path / "nope")
