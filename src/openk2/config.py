"""ModelConfig: the one source of truth for a K2-style model's shapes, presets and HF config.json mapping."""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

_SUPPORTED_ROPE_TYPES = ("default", "yarn")

# HF config.json keys that carry no math for us (bookkeeping, generation defaults, remote-code pointers).
_IGNORED_HF_KEYS = {
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "pretraining_tp", "attention_dropout", "quantization_config", "output_router_logits",
    "initializer_range", "num_mtp_layers", "_name_or_path", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "chunk_size_feed_forward", "is_encoder_decoder", "tie_encoder_decoder",
    "id2label", "label2id", "problem_type", "tokenizer_class", "task_specific_params", "bad_words_ids",
    "head_dim", "qk_head_dim", "ep_size", "mtp_loss_scaling_factor",
}


@dataclass(kw_only=True)
class ModelConfig:
    """Shapes and hyper-parameters of a DeepSeek-V3 / Kimi K2 style MoE transformer (HF field names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense (first_k_dense_replace) layers' MLP width
    moe_intermediate_size: int  # width of each routed expert
    num_hidden_layers: int
    num_attention_heads: int
    # MLA
    q_lora_rank: int | None  # None: q_proj is a full-rank projection (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MoE
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    n_group: int = 1  # K2 uses no expert grouping; DeepSeek-V3 uses 8 groups, top-4 groups
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    aux_loss_alpha: float = 0.0  # sequence-wise balance loss weight; 0 turns it off
    bias_update_rate: float = 1e-3  # aux-loss-free balancing: bias += rate * sign(mean_load - load)
    # position encoding
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"type": "yarn", "factor", "original_max_position_embeddings", ...}
    rope_interleave: bool = True  # DeepSeek checkpoints store rotary dims as interleaved pairs
    # misc
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: str = "bfloat16"  # the dtype checkpoints are stored in

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ValueError if the shapes are inconsistent."""
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size", "intermediate_size"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must lie in "
                             f"[0, num_hidden_layers={self.num_hidden_layers}]")
        if self.num_moe_layers:
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must lie in "
                                 f"[1, n_routed_experts={self.n_routed_experts}]")
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"n_routed_experts={self.n_routed_experts} is not divisible by "
                                 f"n_group={self.n_group}")
            if not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"topk_group={self.topk_group} must lie in [1, n_group={self.n_group}]")
            per_group = self.n_routed_experts // self.n_group
            if self.n_group > 1 and self.topk_group * per_group < self.num_experts_per_tok:
                raise ValueError("topk_group groups hold fewer experts than num_experts_per_tok")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("type", self.rope_scaling.get("rope_type", "default"))
            if rope_type not in _SUPPORTED_ROPE_TYPES:
                raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: "
                                 f"{', '.join(_SUPPORTED_ROPE_TYPES)})")
            if rope_type == "yarn":
                for key in ("factor", "original_max_position_embeddings"):
                    if key not in self.rope_scaling:
                        raise ValueError(f"yarn rope_scaling needs {key!r}")

    # ------------------------------------------------------------- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` uses a MoE block (DeepSeek-V3: all layers after the first k dense)."""
        return layer_idx >= self.first_k_dense_replace

    @property
    def sparsity(self) -> float:
        """Total over activated routed experts (the report's definition; K2: 384/8 = 48)."""
        return self.n_routed_experts / self.num_experts_per_tok

    def num_params(self):
        """Parameter counts: `.total`, `.activated` and a per-component breakdown."""
        return count_params(self)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s): {', '.join(sorted(unknown))}")
        data = copy.deepcopy(asdict(self))
        data.update(changes)
        return ModelConfig(**data)

    # ------------------------------------------------------------- presets
    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """A named configuration: kimi-k2, deepseek-v3, small, tiny."""
        try:
            builder = _PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; choose from {', '.join(_PRESETS)}") from None
        return builder()

    @staticmethod
    def preset_names() -> list[str]:
        return list(_PRESETS)

    # ------------------------------------------------------------- HF mapping
    @classmethod
    def from_hf(cls, source: dict[str, Any] | str | Path) -> ModelConfig:
        """Build from an HF config.json (dict, file or checkpoint directory); transformers 4.x and 5.x keys."""
        hf = _read_hf_config(source)
        return _config_from_hf_dict(hf)

    def to_hf(self) -> dict[str, Any]:
        """An HF `config.json` dict that transformers' DeepseekV3ForCausalLM loads."""
        out: dict[str, Any] = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
        }
        for f in fields(self):
            if f.name in ("bias_update_rate", "dtype", "rope_scaling"):
                continue
            out[f.name] = getattr(self, f.name)
        out["num_key_value_heads"] = self.num_attention_heads
        out["moe_layer_freq"] = 1
        out["scoring_func"] = "sigmoid"
        out["topk_method"] = "noaux_tc"
        out["seq_aux"] = True
        out["hidden_act"] = "silu"
        out["num_nextn_predict_layers"] = 0
        out["torch_dtype"] = self.dtype
        out["openk2_bias_update_rate"] = self.bias_update_rate
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            out["rope_scaling"] = scaling
        return out


# ---------------------------------------------------------------------- parameter counting
@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of a config; `activated` is what one token touches (k of the routed experts)."""

    total: int
    activated: int
    breakdown: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return {"total": self.total, "activated": self.activated, "breakdown": dict(self.breakdown)}


def count_params(cfg: ModelConfig) -> ParamCount:
    """Count parameters from the shapes alone (no model is built), as the HF checkpoint stores them."""
    h, n_heads = cfg.hidden_size, cfg.num_attention_heads
    bias = cfg.attention_bias
    if cfg.q_lora_rank is None:
        q_proj = h * n_heads * cfg.qk_head_dim
    else:
        q_proj = h * cfg.q_lora_rank + bias * cfg.q_lora_rank + cfg.q_lora_rank * n_heads * cfg.qk_head_dim
    kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    attention_per_layer = (
        q_proj
        + h * kv_a + bias * kv_a
        + cfg.kv_lora_rank * n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        + n_heads * cfg.v_head_dim * h + bias * h
    )
    norms_per_layer = 2 * h + cfg.kv_lora_rank + (cfg.q_lora_rank or 0)
    num_moe, num_dense = cfg.num_moe_layers, cfg.first_k_dense_replace
    expert = 3 * h * cfg.moe_intermediate_size
    breakdown = {
        "embedding": cfg.vocab_size * h,
        "attention": attention_per_layer * cfg.num_hidden_layers,
        "norms": norms_per_layer * cfg.num_hidden_layers + h,
        "dense_mlp": 3 * h * cfg.intermediate_size * num_dense,
        "routed_experts": expert * cfg.n_routed_experts * num_moe,
        "shared_experts": expert * cfg.n_shared_experts * num_moe,
        # router weight plus its aux-loss-free correction bias (stored in checkpoints as e_score_correction_bias)
        "router": (cfg.n_routed_experts * h + cfg.n_routed_experts) * num_moe,
        "lm_head": 0 if cfg.tie_word_embeddings else cfg.vocab_size * h,
    }
    total = sum(breakdown.values())
    routed_active = expert * cfg.num_experts_per_tok * num_moe
    activated = total - breakdown["routed_experts"] + routed_active
    return ParamCount(total=total, activated=activated, breakdown=breakdown)


# ---------------------------------------------------------------------- HF parsing
def _read_hf_config(source: dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(source, dict):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no HF config found at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def _normalise_rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, rope_scaling) from either `rope_scaling` (4.x) or `rope_parameters` (5.x)."""
    theta = hf.pop("rope_theta", None)
    scaling = hf.pop("rope_scaling", None)
    params = hf.pop("rope_parameters", None)
    if params is not None:
        params = dict(params)
        theta = params.pop("rope_theta", theta)
        if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("rope_theta", None)
        if rope_type == "default":
            scaling = None
        else:
            scaling = {"type": rope_type, **scaling}
    return float(theta if theta is not None else 10000.0), scaling


def _config_from_hf_dict(hf: dict[str, Any]) -> ModelConfig:
    hf = dict(hf)
    model_type = hf.get("model_type", "deepseek_v3")
    if model_type not in ("deepseek_v3", "kimi_k2"):
        raise ValueError(f"model_type {model_type!r} is not a DeepSeek-V3 / Kimi K2 model")
    rope_theta, rope_scaling = _normalise_rope(hf)

    unsupported: list[str] = []

    def expect(key: str, allowed: tuple[Any, ...]) -> None:
        if key in hf and hf.pop(key) not in allowed:
            unsupported.append(f"{key} (supported: {', '.join(map(repr, allowed))})")

    expect("scoring_func", ("sigmoid",))
    expect("topk_method", ("noaux_tc",))
    expect("hidden_act", ("silu",))
    expect("moe_layer_freq", (1,))
    expect("seq_aux", (True,))
    heads = hf.get("num_attention_heads")
    if "num_key_value_heads" in hf and hf.pop("num_key_value_heads") not in (None, heads):
        unsupported.append("num_key_value_heads (MLA needs it equal to num_attention_heads)")
    if unsupported:
        raise ValueError("unsupported config values that change the math: " + "; ".join(unsupported))

    mtp = hf.pop("num_nextn_predict_layers", None) or 0
    if mtp:
        warnings.warn(f"config has {mtp} MTP layer(s) (num_nextn_predict_layers); MTP is not part of K2 and "
                      "their weights are skipped", stacklevel=3)
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
    bias_rate = hf.pop("openk2_bias_update_rate", None)
    eos = hf.pop("eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None

    known = {f.name for f in fields(ModelConfig)} - {"dtype", "rope_theta", "rope_scaling", "bias_update_rate"}
    kwargs: dict[str, Any] = {}
    unknown: list[str] = []
    for key, value in hf.items():
        if key in known:
            kwargs[key] = value
        elif key not in _IGNORED_HF_KEYS:
            unknown.append(key)
    if unknown:
        warnings.warn(f"ignoring unrecognised config keys: {', '.join(sorted(unknown))}", stacklevel=3)
    kwargs.update(rope_theta=rope_theta, rope_scaling=rope_scaling, dtype=str(dtype), eos_token_id=eos)
    if bias_rate is not None:
        kwargs["bias_update_rate"] = float(bias_rate)
    missing = [f.name for f in fields(ModelConfig)
               if f.name not in kwargs and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"HF config is missing required key(s): {', '.join(missing)}")
    return ModelConfig(**kwargs)


# ---------------------------------------------------------------------- presets
_REFERENCE_K2 = {
    # ../shared/reference/kimi-k2-instruct-config.json (the released Kimi-K2-Instruct config)
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 384,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.827, "aux_loss_alpha": 0.001,
    "max_position_embeddings": 131072, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-6, "bos_token_id": 163584, "eos_token_id": 163585,
}


def _kimi_k2() -> ModelConfig:
    return ModelConfig(**copy.deepcopy(_REFERENCE_K2))


def _deepseek_v3() -> ModelConfig:
    # DeepSeek-V3's released config.json, main model only (its MTP layer is not counted or built).
    return ModelConfig(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4, norm_topk_prob=True,
        routed_scaling_factor=2.5, aux_loss_alpha=0.001, max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
    )


def _small() -> ModelConfig:
    # K2's structure at a size a CPU steps through in seconds: MLA with both low-rank paths, one dense layer,
    # shared expert, sparsity 16 (64 experts, 4 active; K2's 48 would need 8x the expert memory).
    return ModelConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=4,
        first_k_dense_replace=1, routed_scaling_factor=2.827, max_position_embeddings=2048, rope_theta=50000.0,
    )


def _tiny() -> ModelConfig:
    # Trains at thousands of tokens/s on 2 CPU cores while keeping K2's structure: MLA (low-rank q and kv,
    # decoupled rope), 1 dense layer then MoE layers, one shared expert, sigmoid routing, sparsity 16.
    return ModelConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, routed_scaling_factor=2.827, max_position_embeddings=1024, rope_theta=50000.0,
    )


_PRESETS = {"kimi-k2": _kimi_k2, "deepseek-v3": _deepseek_v3, "small": _small, "tiny": _tiny}

__all__ = ["ModelConfig", "ParamCount", "count_params"]
