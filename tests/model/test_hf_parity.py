"""Equivalence with transformers' DeepseekV3ForCausalLM: logits, gradients, and checkpoints both ways."""

from __future__ import annotations

import pytest
import torch

from openk2 import K2ForCausalLM

from .conftest import randomise_extras, small_config

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "q_lora+yarn+interleave": {},
    "no_q_lora": {"q_lora_rank": None},
    "groups": {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3},
    "no_yarn+halves": {"rope_scaling": None, "rope_interleave": False},
    "k2_yarn_betas": {"rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 16,
                                       "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                      "norm_topk_prob": False, "n_shared_experts": 2},
}


def _hf_from_ours(model: K2ForCausalLM, tmp_path) -> torch.nn.Module:
    model.save_pretrained(tmp_path)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    )
    return hf.eval()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _hf_grads_as_ours(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF gradients keyed by our parameter names (experts stacked [E, out, in])."""
    grads: dict[str, torch.Tensor] = {}
    per_expert: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, p in hf.named_parameters():
        if p.grad is None:
            continue
        if name.endswith("experts.gate_up_proj"):  # transformers 5.x: fused [E, 2I, D]
            gate, up = p.grad.chunk(2, dim=1)
            prefix = name.removesuffix(".gate_up_proj")
            grads[prefix + ".gate_proj"], grads[prefix + ".up_proj"] = gate, up
        elif ".experts." in name and name.split(".experts.")[1][0].isdigit():  # 4.x: one module per expert
            prefix, rest = name.split(".experts.")
            e, proj = rest.split(".")[:2]
            per_expert.setdefault(f"{prefix}.experts.{proj}", []).append((int(e), p.grad))
        else:
            grads[name] = p.grad
    for key, items in per_expert.items():
        grads[key] = torch.stack([g for _, g in sorted(items, key=lambda t: t[0])])
    return grads


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_hf(name, tmp_path):
    torch.manual_seed(0)
    cfg = small_config(**CONFIGS[name])
    ours = K2ForCausalLM(cfg).eval()
    randomise_extras(ours, seed=1)
    hf = _hf_from_ours(ours, tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (3, 37))

    out = ours(ids, labels=ids)
    ref = hf(ids, labels=ids)
    assert _rel_err(out.logits, ref.logits) <= 1e-5
    assert torch.allclose(out.loss, ref.loss, rtol=1e-5)

    out.loss.backward()
    ref.loss.backward()
    hf_grads = _hf_grads_as_ours(hf)
    ours_named = dict(ours.named_parameters())
    assert set(hf_grads) == {n for n, p in ours_named.items() if p.grad is not None}
    for key, grad in hf_grads.items():
        assert _rel_err(ours_named[key].grad, grad) <= 1e-4, key


def test_hf_checkpoint_loads_into_ours(tmp_path):
    torch.manual_seed(0)
    cfg = small_config()
    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"})
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    randomise_extras(hf, seed=2)
    hf.save_pretrained(tmp_path)
    ours = K2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 21))
    with torch.no_grad():
        assert _rel_err(ours(ids).logits, hf(ids).logits) <= 1e-5


def test_ours_round_trips_through_hf(tmp_path):
    torch.manual_seed(0)
    cfg = small_config()
    ours = K2ForCausalLM(cfg).eval()
    randomise_extras(ours, seed=3)
    hf = _hf_from_ours(ours, tmp_path / "a")
    hf.save_pretrained(tmp_path / "b")
    back = K2ForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32)
    for (name, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
