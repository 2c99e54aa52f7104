"""`openk2 plan`: every shipped config plans and builds on the meta device; the counts match built shares; the
activation estimate matches a measured CPU forward."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from openk2.cli.plan import plan_main
from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM
from openk2.train.config import load_run_config
from openk2.train.memory import MemorySection, allocated_bytes, apply_memory_options
from openk2.train.parallel.activations import ActivationModel
from openk2.train.parallel.build import build_model_part, meta_model_part
from openk2.train.parallel.config import ParallelConfig
from openk2.train.parallel.mesh import ParallelMesh
from openk2.train.parallel.plan import activation_model, plan, rope_table_bytes
from tests.train.live_storages import NewStorages

CONFIGS = sorted((Path(__file__).parents[3] / "configs").glob("*.toml"))
NOT_RUN_PREFIXES = ("pipeline-", "rl-", "synth-")  # other commands' files (openk2 pipeline / rl / synth)
NOT_RUN_CONFIGS = {p.name for p in CONFIGS if p.name.startswith(NOT_RUN_PREFIXES)}
# Relative tolerance of plan / measured tensor bytes (_held_after_forward) on the micro model below, per option set.
# Measured (4 x 128 tokens): fp32 none, selective, full, fp8, selective+fp8 1.000; bf16 autocast none 0.994,
# selective 1.009 (padded expert rows planned at their bound), full 1.000. Full recompute holds only layer inputs,
# RoPE tables and the head: nothing data-dependent. FP8 was 0.975 / 0.932 while its hooks quantised each SwiGLU
# block input twice (gate and up both save it; docs/parallelism.md): 0.2% catches that copy coming back.
ACTIVATION_TOLERANCE = {"none": 0.01, "selective": 0.02, "full": 0.002, "fp8": 0.002, "selective+fp8": 0.002}


def test_the_config_list_is_complete():
    assert {"pipeline-tiny.toml", "rl-tiny.toml", "synth-tiny.toml"} <= NOT_RUN_CONFIGS
    assert {"tiny.toml", "kimi-k2.toml", "kimi-k2-pp16-ep16.toml"} <= {p.name for p in CONFIGS} - NOT_RUN_CONFIGS


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.name not in NOT_RUN_CONFIGS], ids=lambda p: p.name)
def test_every_shipped_run_config_plans_and_builds_on_meta(path):
    cfg = load_run_config(path)
    result = plan(cfg)
    assert result["world_size"] == cfg.parallel.world_size == len(result["per_rank"])
    assert result["max_rank_bytes"] == max(r["total_bytes"] for r in result["per_rank"]) > 0
    mesh = ParallelMesh(cfg.parallel, None, 0, 0, 0, 0)
    part, _ = meta_model_part(cfg.model, mesh)
    assert all(p.is_meta for p in part.parameters())


def test_plan_json_has_the_documented_keys(capsys):
    assert plan_main(["--config", "configs/tiny-pp2.toml", "--json", "--world", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 4 and out["layout"]["dp"] == 2
    for row in out["per_rank"]:
        assert {"rank", "params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "total_bytes"} <= set(row)
    with pytest.raises(ValueError, match="not a multiple"):
        plan(load_run_config("configs/tiny-pp2.toml"), world=3)


def test_planned_parameter_bytes_equal_the_built_shares():
    """pp=2 (2 virtual stages) x ep=2: each rank's planned bytes are what build_model_part allocates."""
    cfg = load_run_config("configs/tiny.toml", ["parallel.pp=2", "parallel.ep=2", "parallel.pp_virtual_stages=2",
                                                "train.grad_accum=2"])
    result = plan(cfg)
    for row in result["per_rank"]:
        mesh = ParallelMesh(cfg.parallel, None, row["rank"], row["pp_rank"], row["dp_rank"], row["ep_rank"])
        part, _ = build_model_part(cfg.model, mesh, torch.device("cpu"), init_seed=0)
        built = sum(p.numel() * p.element_size() for p in part.parameters())
        assert row["params_bytes"] == built == row["grads_bytes"]


@pytest.mark.parametrize("options", [MemorySection(), MemorySection(recompute="selective"),
                                     MemorySection(recompute="full"), MemorySection(fp8_activations=True),
                                     MemorySection(recompute="selective", fp8_activations=True)],
                         ids=["none", "selective", "full", "fp8", "selective+fp8"])
def test_activation_estimate_matches_a_measured_cpu_forward(options, request):
    """Tensor bytes a forward leaves for backward (`_held_after_forward`), fp32, CPU."""
    cfg = ModelConfig.preset("tiny").replace(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2)
    model = K2ForCausalLM(cfg, init_seed=0)
    ids = torch.randint(0, cfg.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    held = _held_after_forward(model, ids, options)
    # The CPU forward uses a fused (flash) SDPA kernel since v is padded to the q/k head dim (attention_core).
    estimate = ActivationModel(cfg, options, act_bytes=4, flash_attention=True, seq_len=128)
    layers = sum(estimate.layer(cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers))
    predicted = ids.numel() * (layers + estimate.head() + rope_table_bytes(cfg))
    assert predicted == pytest.approx(held, rel=ACTIVATION_TOLERANCE[request.node.callspec.id])


def test_in_flight_count_follows_the_schedule():
    from openk2.train.parallel.plan import in_flight_microbatches

    cfg = ParallelConfig(pp=4, pp_virtual_stages=2)
    assert [in_flight_microbatches(cfg, r, 8) for r in range(4)] == [11, 9, 7, 5]  # (v-1) pp + 2 (pp-1-r) + 1
    assert in_flight_microbatches(ParallelConfig(pp=4, pp_schedule="gpipe", pp_virtual_stages=1), 0, 8) == 8


MICRO_SETS = ["model.vocab_size=512", "model.hidden_size=128", "model.intermediate_size=256",
              "model.moe_intermediate_size=64", "model.num_hidden_layers=3", "model.num_attention_heads=4",
              "model.q_lora_rank=64", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=16",
              "model.v_head_dim=16", "model.n_routed_experts=8", "model.num_experts_per_tok=2"]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_bf16_cpu_plan_counts_the_short_attention_and_padded_expert_rows(recompute):
    """bf16 autocast on CPU at 128 keys: the plan picks the model's short attention (fp32 T x S probabilities)
    and aligned expert rows by their own rules, and its bytes match a measured forward."""
    cfg = load_run_config("configs/tiny.toml", MICRO_SETS + [
        "train.precision=bf16", "train.batch_size=4", "data.seq_len=128", f"memory.recompute={recompute}"])
    part, _ = meta_model_part(cfg.model, ParallelMesh(cfg.parallel, None, 0, 0, 0, 0))
    act = activation_model(cfg, cfg.parallel, part, "cpu")
    assert act.short_attention and act.autocast and act.expert_pad_rows > 0
    model = K2ForCausalLM(cfg.model, init_seed=0)
    ids = torch.randint(0, cfg.model.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    held = _held_after_forward(model, ids, cfg.memory, autocast=True)
    layers = range(cfg.model.num_hidden_layers)
    per_token = sum(act.layer(cfg.model.is_moe_layer(i)) for i in layers) + act.head() + rope_table_bytes(cfg.model)
    predicted = ids.numel() * per_token
    predicted += sum(act.layer_weight_copies(cfg.model.is_moe_layer(i)) for i in layers) + act.head_weight_copy()
    assert predicted == pytest.approx(held, rel=ACTIVATION_TOLERANCE[recompute])
    assert plan(cfg, device_type="cpu")["per_rank"][0]["activation_bytes"] == int(predicted)


def _held_after_forward(model, ids, options, autocast: bool = False) -> int:
    """Bytes of the tensors a forward allocated that are still alive when it returns (what backward reads), the
    median of 3 forwards with the memory options applied: what the plan predicts, and what CUDA's
    memory_allocated would count. Not glibc's heap in use (benchmarks/bench_memory.py's CPU measure): that adds
    0.17-0.30 MB per forward that is no tensor (autograd's nodes and saved-variable records, recompute's RNG states,
    Python objects; host memory on a GPU too), whatever the token count, checked here to contain the tensors."""
    handle = apply_memory_options(model, options)
    held, heap = [], []
    for _ in range(3):
        gc.collect()
        before = allocated_bytes(torch.device("cpu"))
        weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), ids]}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), NewStorages(weights) as storages:
            out = model(ids, labels=ids)
        held.append(storages.alive_bytes())
        if before is not None:
            heap.append(allocated_bytes(torch.device("cpu")) - before)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        del out
    handle.remove()
    assert not heap or sorted(held)[1] <= sorted(heap)[1]
    return sorted(held)[1]
