"""Meta-device construction: each rank allocates only its share, initialised exactly as the single-process model."""

from __future__ import annotations

import torch

from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM
from openk2.train.parallel.build import build_model_part, meta_model_part
from openk2.train.parallel.config import ParallelConfig
from openk2.train.parallel.mesh import ParallelMesh, init_parallel
from openk2.train.parallel.state import gather_full_state, load_hf_part, local_tensors
from tests.train.conftest import MICRO_MODEL
from tests.train.parallel.ranks import run_ranks

SEED = 1234


def _config(**overrides) -> ModelConfig:
    raw = {**MICRO_MODEL, "num_hidden_layers": 4, **overrides}
    return ModelConfig.preset(raw.pop("preset")).replace(**raw)


def _build_and_gather(rank: int, parallel: dict) -> dict:
    mesh = init_parallel(ParallelConfig(**parallel), torch.device("cpu"))
    part, experts = build_model_part(_config(), mesh, torch.device("cpu"), SEED)
    held = sum(p.numel() for p in part.parameters())
    full = gather_full_state(part, mesh)
    return {"held": held, "experts": sorted(experts), "full": full}


def test_pp2_times_ep2_gathered_equals_the_single_process_model_bit_for_bit():
    """4 gloo ranks (pp=2 with 2 virtual stages x ep=2): the gathered shares equal K2ForCausalLM(seed)."""
    out = run_ranks(4, _build_and_gather, {"pp": 2, "ep": 2, "pp_virtual_stages": 2})
    reference = K2ForCausalLM(_config(), init_seed=SEED)
    want = reference.state_dict()
    got = out[0]["full"]
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    total = sum(p.numel() for p in reference.parameters())
    assert all(out[r]["held"] < total / 2 for r in range(4))  # each rank: half the stages, half the experts
    assert sum(out[r]["held"] for r in range(4)) > total  # dense weights are replicated over ep


def test_a_different_seed_gives_different_weights_and_the_global_seed_decides_the_default():
    cfg = _config()
    a, b = K2ForCausalLM(cfg, init_seed=1), K2ForCausalLM(cfg, init_seed=2)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)
    torch.manual_seed(7)
    c = K2ForCausalLM(cfg)
    torch.manual_seed(7)
    d = K2ForCausalLM(cfg)
    assert c.init_seed == d.init_seed and torch.equal(c.model.layers[1].mlp.experts.up_proj,
                                                      d.model.layers[1].mlp.experts.up_proj)


def test_meta_build_allocates_nothing_and_materialises_like_the_eager_model():
    cfg = _config(tie_word_embeddings=True)
    part, _ = meta_model_part(cfg, ParallelMesh.single())
    assert all(p.is_meta for p in part.parameters())
    built, _ = build_model_part(cfg, ParallelMesh.single(), torch.device("cpu"), SEED)
    assert built.lm_head.weight is built.model.embed_tokens.weight
    eager = K2ForCausalLM(cfg, init_seed=SEED)
    for (name, got), want in zip(built.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    assert torch.equal(built.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)


def test_loading_an_hf_checkpoint_into_a_share_reads_only_the_owned_tensors(tmp_path):
    """Each of the 4 shares of pp=2 (2 virtual stages) x ep=2 reads exactly its own bytes and gets the
    checkpoint's values; the four together read more than the file only by the replicated dense weights."""
    cfg = _config()
    reference = K2ForCausalLM(cfg, init_seed=SEED)
    reference.save_pretrained(tmp_path)
    file_bytes = sum(t.nbytes for t in reference.state_dict().values())
    parallel = ParallelConfig(pp=2, ep=2, pp_virtual_stages=2)
    want = reference.state_dict()
    for pp_rank in range(2):
        for ep_rank in range(2):
            mesh = ParallelMesh(parallel, None, pp_rank * 2 + ep_rank, pp_rank, 0, ep_rank)
            part, experts = meta_model_part(cfg, mesh)
            part.to_empty(device="cpu")
            read = load_hf_part(part, cfg, tmp_path, mesh)
            held = local_tensors(part)
            assert read == sum(t.nbytes for t in held.values()) < file_bytes / 2
            for name, tensor in held.items():
                source = want[name]
                if name in experts:
                    n = tensor.shape[0]
                    source = source[ep_rank * n:(ep_rank + 1) * n]
                assert torch.equal(tensor, source), name
