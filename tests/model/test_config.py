"""ModelConfig: presets, parameter counts, HF config.json mapping."""

import json
import warnings
from pathlib import Path

import pytest

from openk2.config import ModelConfig

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "kimi-k2-instruct-config.json"


def test_preset_parameter_counts():
    assert ModelConfig.preset("kimi-k2").num_params().total == 1_026_408_232_448
    assert ModelConfig.preset("deepseek-v3").num_params().total == 671_026_419_200
    k2 = ModelConfig.preset("kimi-k2").num_params()
    assert sum(k2.breakdown.values()) == k2.total
    assert k2.breakdown["routed_experts"] == 384 * 3 * 7168 * 2048 * 60
    assert k2.activated == k2.total - 376 * 3 * 7168 * 2048 * 60


def test_param_count_matches_a_built_model():
    from openk2 import K2ForCausalLM

    for name in ("tiny",):
        cfg = ModelConfig.preset(name)
        model = K2ForCausalLM(cfg)
        built = sum(p.numel() for p in model.parameters()) + sum(
            m.gate.e_score_correction_bias.numel() for m in model.moe_layers())
        assert built == cfg.num_params().total


@pytest.mark.skipif(not REFERENCE.is_file(), reason="shared reference config not present")
def test_released_k2_config_matches_preset():
    assert ModelConfig.from_hf(REFERENCE) == ModelConfig.preset("kimi-k2")


def test_hf_round_trip_and_5x_rope_parameters():
    cfg = ModelConfig.preset("kimi-k2")
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    hf = cfg.to_hf()
    scaling = hf.pop("rope_scaling")
    hf["rope_parameters"] = {"rope_type": scaling.pop("type"), "rope_theta": hf.pop("rope_theta"), **scaling}
    hf["dtype"] = hf.pop("torch_dtype")
    hf["model_type"] = "kimi_k2"
    assert ModelConfig.from_hf(hf) == cfg


def test_unsupported_math_keys_are_named():
    hf = ModelConfig.preset("tiny").to_hf()
    hf["scoring_func"] = "softmax"
    hf["hidden_act"] = "gelu"
    with pytest.raises(ValueError, match="scoring_func.*hidden_act"):
        ModelConfig.from_hf(hf)
    hf = ModelConfig.preset("tiny").to_hf()
    hf["rope_scaling"] = {"type": "longrope", "factor": 2.0}
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_hf(hf)


def test_mtp_layers_warn_and_bookkeeping_keys_are_ignored(tmp_path):
    hf = ModelConfig.preset("tiny").to_hf()
    hf.update(num_nextn_predict_layers=1, transformers_version="4.48.3", use_cache=True)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.warns(UserWarning, match="MTP"):
        cfg = ModelConfig.from_hf(tmp_path)
    assert cfg == ModelConfig.preset("tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ModelConfig.from_hf(ModelConfig.preset("tiny").to_hf())


def test_bad_configs_raise_value_errors():
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.preset("gpt5")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.preset("tiny").replace(num_experts_per_tok=64)
    with pytest.raises(ValueError, match="missing required"):
        ModelConfig.from_hf({"model_type": "deepseek_v3", "hidden_size": 8})
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        ModelConfig.preset("tiny").replace(hiden_size=3)
