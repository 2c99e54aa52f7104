"""`openk2 plan`: every rank's share of a run's model built on the meta device, and its device bytes.

Per rank: parameters, gradients, master weights, optimizer state (counted from the meta-built share, so the
counts are the trainer's own), activations (activations.py, at train.batch_size x data.seq_len under the
`[memory]` options, times the micro-batches the pipeline schedule keeps in flight on that rank, counted on the
rank's own interleaved 1F1B action list with parallel.pp_extra_warmup's extra forwards; each stage-micro-batch
also holds its RoPE tables, `rope_table_bytes`) and transient
buffers (the optimizer step's flat gathers, pipeline receive buffers, a recomputed layer). Total = the
persistent states + the larger of the two phases (forward/backward vs optimizer step).

Two state policies, `parallel.param_dtype`'s two modes: "fp32" (fp32 weights replicated within their group, fp32
gradients, DistributedMuonClip's state split over the group: the fp32 momentum (4 B) of the Muon matrices a
rank owns, counted with the trainer's own owner assignment for the busiest rank, and the AdamW DTensor shards:
moments 8 B + fp32 master 4 B per element); "bf16" is the report's (bf16 weights, fp32 gradients, an fp32
master copy of every weight sharded alike: the Muon owner's and the AdamW shards). Both are checked against
the bytes a rank's tensors hold (held.py, tests/train/parallel/test_memory.py).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch

from openk2.config import ModelConfig
from openk2.model.attention_core import short_path_rule
from openk2.model.moe import CPU_ALIGN_ROWS, RoutedExperts, pads_expert_rows
from openk2.optim.param_groups import default_muon_filter
from openk2.train.config import RunConfig
from openk2.train.parallel.activations import ActivationModel
from openk2.train.parallel.build import full_name_of, meta_model_part
from openk2.train.parallel.config import ParallelConfig
from openk2.train.parallel.dist_muon import DEFAULT_BUCKET_NUMEL
from openk2.train.parallel.mesh import ParallelMesh
from openk2.train.parallel.owners import assign_owners
from openk2.train.parallel.pipeline import PipelineModel, stage_layer_ranges, stages_of_rank
from openk2.train.parallel.warmup_schedule import peak_held, rank_actions

STATE_POLICIES = {"fp32": {"param": 4, "grad": 4, "master": 0}, "bf16": {"param": 2, "grad": 4, "master": 4}}


@dataclass
class RankPlan:
    """Device bytes of one rank."""

    rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    num_params: int
    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    comm_bytes: int
    total_bytes: int


def in_flight_microbatches(parallel: ParallelConfig, pp_rank: int, num_microbatches: int) -> int:
    """Stage-micro-batches whose activations a pipeline rank holds at its peak under the configured schedule."""
    pp, v, m = parallel.pp, len(stages_of_rank(parallel, pp_rank)), num_microbatches
    if pp == 1:
        return 1  # each micro-batch's backward runs before the next forward
    schedule = parallel.pp_schedule
    if schedule in ("gpipe", "looped_bfs"):
        return m * v  # every forward before any backward
    if schedule == "1f1b":
        return min(m, pp - pp_rank)
    if schedule == "interleaved_1f1b":  # counted on the rank's own action list, extra warm-up forwards included
        return int(peak_held(rank_actions(pp_rank, pp, v, m, parallel.pp_extra_warmup)))
    # The zero-bubble variants, approximated like interleaved 1F1B: torch's warm-up count + 1.
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), m * v)
    return min(warmup + 1, m * v)


def _shard(numel: int, group: int) -> int:
    return math.ceil(numel / group)


def _owned_muon_numel(shapes: list[tuple[int, ...]], group: int, ns_steps: int) -> int:
    """Elements of Muon matrices the busiest rank of a replication group owns (distributed MuonClip's owners)."""
    owned = [0] * group
    for unit in assign_owners(shapes, group, ns_steps):
        shape = shapes[unit.index]
        owned[unit.owner] += math.prod(shape[1:]) * (unit.stop - unit.start) if unit.is_rows else math.prod(shape)
    return max(owned, default=0)


def plan_rank(cfg: RunConfig, parallel: ParallelConfig, pp_rank: int, states: str = "fp32",
              device_type: str = "cuda") -> RankPlan:
    """The bytes of rank (pp_rank, 0, 0) (dp and ep ranks of one pipeline rank hold equal shares)."""
    policy = STATE_POLICIES[states]
    mesh = ParallelMesh(parallel, None, pp_rank * parallel.dp * parallel.ep, pp_rank, 0, 0)
    part, expert_names = meta_model_part(cfg.model, mesh)
    if parallel.shard == "fsdp2":
        return _plan_fsdp2(cfg, parallel, part, expert_names, pp_rank, device_type,
                           gathered_bytes=2 if states == "bf16" else 4)
    rename = full_name_of(part)
    groups = {"expert": parallel.dp, "dense": parallel.dp * parallel.ep}
    members: dict[tuple[str, str], list[tuple[int, ...]]] = defaultdict(list)
    for name, p in part.named_parameters():
        full = rename(name)
        kind = "muon" if cfg.optim.optimizer == "muon" and default_muon_filter(full, p) else "adamw"
        members[("expert" if full in expert_names else "dense", kind)].append(tuple(p.shape))
    num = sum(math.prod(s) for shapes in members.values() for s in shapes)
    optimizer = master = step_buffers = 0
    for where, size in groups.items():
        owned = _owned_muon_numel(members[(where, "muon")], size, cfg.optim.ns_steps)
        adam = sum(_shard(math.prod(s), size) for s in members[(where, "adamw")])  # DTensor Shard(0): rank 0's
        optimizer += 4 * owned + 8 * adam  # fp32 momentum of the owned matrices | AdamW's two moment shards
        master += 4 * adam + (4 * owned if policy["master"] else 0)  # fp32 master shards
        # The step's transients: the owned reduced gradients and Newton-Schulz copies (batch, directions,
        # result: 3 x 4 B), two buckets in flight, the AdamW gradient shards and one gathered parameter.
        largest_adam = max((math.prod(s) for s in members[(where, "adamw")]), default=0)
        group_muon = sum(math.prod(s) for s in members[(where, "muon")])
        in_flight = 2 * 4 * min(DEFAULT_BUCKET_NUMEL, group_muon) if size > 1 else 0
        step_buffers = max(step_buffers, 16 * owned + in_flight + 4 * adam + 4 * largest_adam)
    activations, pipeline_buffers, transient = _activation_bytes(cfg, parallel, part, pp_rank, device_type,
                                                                 states == "fp32")
    persistent = num * (policy["param"] + policy["grad"]) + master + optimizer
    total = persistent + max(activations + pipeline_buffers + transient, step_buffers)
    return RankPlan(rank=mesh.rank, pp_rank=pp_rank, dp_rank=0, ep_rank=0, num_params=num,
                    params_bytes=num * policy["param"], grads_bytes=num * policy["grad"], master_bytes=master,
                    optimizer_bytes=optimizer, activation_bytes=activations,
                    comm_bytes=max(pipeline_buffers, step_buffers), total_bytes=total)


def _plan_fsdp2(cfg: RunConfig, parallel: ParallelConfig, part, expert_names: frozenset[str], pp_rank: int,
                device_type: str, gathered_bytes: int) -> RankPlan:
    """Rank (pp_rank, 0, 0) under FSDP2 (fsdp.py): every parameter, gradient and optimizer tensor is its dim-0
    shard, rank 0's of its group being the largest (FSDP2 pads every rank's storage to it): this ep rank's expert
    slices [E/ep, ...] over dp, the dense tensors over dp x ep, whose 2-D Muon matrices have owners in dp x ep.
    With pp > 1 torch's PipelineStage keeps each stage's weights and gradients unsharded from its first backward
    to the reduce-scatter after its last, so the forward/backward transient is the rank's whole share unsharded
    (weights at `gathered_bytes`, fp32 gradients) plus the pipeline buffers. Otherwise: the forward and
    backward hold the root unit (embedding, norm, head) all-gathered, two decoder layers all-gathered (the one
    running and the one prefetched) and one layer's unsharded gradients before its reduce-scatter; the step, the
    whole fp32 directions of the 2-D Muon matrices the busiest rank owns, gathered, batched and orthogonalised
    (4 x 4 B per element) and the rows scattered back. The shards are fp32 under both state policies (with bf16
    weights they are the masters); `gathered_bytes` is the all-gathered compute copy's element size."""
    dense = parallel.dp * parallel.ep
    rename = full_name_of(part)
    local = sum_muon = sum_adam = 0
    matrices: list[tuple[int, ...]] = []
    for local_name, p in part.named_parameters():
        name = rename(local_name)
        rows = math.ceil(p.shape[0] / (parallel.dp if name in expert_names else dense)) if p.ndim else 1
        numel = rows * math.prod(p.shape[1:])
        local += numel
        if cfg.optim.optimizer == "muon" and default_muon_filter(name, p):
            sum_muon += numel
            if p.ndim == 2:
                matrices.append(tuple(p.shape))
        else:
            sum_adam += numel
    layers = ([layer for stage in part.stages for layer in stage.layers] if isinstance(part, PipelineModel)
              else list(part.model.layers))
    units = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    whole = sum(p.numel() for p in part.parameters())
    largest = max(units, default=0)
    if parallel.pp > 1:
        gathered = (gathered_bytes + 4) * whole  # every stage's weights and fp32 gradients, unsharded
    else:  # root + two layers gathered, one layer's unsharded grads
        gathered = gathered_bytes * (whole - sum(units) + 3 * largest)
    owned = _owned_muon_numel(matrices, dense, cfg.optim.ns_steps)
    step_buffers = 16 * owned + 4 * sum_muon
    activations, pipeline_buffers, transient = _activation_bytes(cfg, parallel, part, pp_rank, device_type,
                                                                 gathered_bytes == 4)
    persistent = 8 * local + 4 * sum_muon + 8 * sum_adam
    total = persistent + max(activations + gathered + pipeline_buffers + transient, step_buffers)
    return RankPlan(rank=pp_rank * dense, pp_rank=pp_rank, dp_rank=0, ep_rank=0, num_params=local,
                    params_bytes=4 * local,
                    grads_bytes=4 * local, master_bytes=0, optimizer_bytes=4 * sum_muon + 8 * sum_adam,
                    activation_bytes=activations, comm_bytes=max(gathered + pipeline_buffers, step_buffers),
                    total_bytes=total)


def activation_model(cfg: RunConfig, parallel: ParallelConfig, part, device_type: str,
                     fp32_weights: bool = True) -> ActivationModel:
    """The per-token activation counts of one micro-batch, with the attention core and the expert-row padding the
    model's own rules (`short_path_rule`, `pads_expert_rows`) pick for this run's dtype and device (compiled
    blocks take the same paths)."""
    model = cfg.model
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device_type == "cuda")
    dtype = torch.bfloat16 if bf16 else torch.float32
    seq, tokens = cfg.data.seq_len, cfg.train.batch_size * cfg.data.seq_len
    # Training attends as many queries as keys (causal or packed-document masks alike).
    short = short_path_rule(device_type, dtype, seq, seq, False)
    experts = [m for m in part.modules() if isinstance(m, RoutedExperts)]
    local = experts[0].gate_proj.shape[0] if experts else 0
    aligned = (bool(experts) and all(type(m).forward is RoutedExperts.forward and m.use_grouped_mm for m in experts)
               and pads_expert_rows(device_type, dtype, tokens * model.num_experts_per_tok, local))
    return ActivationModel(model, cfg.memory, act_bytes=2 if bf16 else 4, flash_attention=not short, seq_len=seq,
                           ep=parallel.ep, short_attention=short, autocast=bf16 and fp32_weights,
                           expert_pad_rows=local * (CPU_ALIGN_ROWS - 1) / tokens if aligned else 0.0)


def rope_table_bytes(model: ModelConfig) -> int:
    """Bytes per token of the RoPE cos and sin tables, fp32 [B, T, R/2] each (model/rope.py), that a forward (each
    pipeline stage's its own) computes once for all its layers: every layer's rope saves them and every recompute
    checkpoint keeps them as an input, so they live until backward under every `[memory]` option but CPU
    offload, which moves them to the host."""
    return 2 * 4 * ((model.qk_rope_head_dim + 1) // 2)


def _activation_bytes(cfg: RunConfig, parallel: ParallelConfig, part, pp_rank: int,
                      device_type: str, fp32_weights: bool = True) -> tuple[int, int, int]:
    """(activations held at the peak, pipeline receive buffers, one recomputed layer) in bytes."""
    model = cfg.model
    act = activation_model(cfg, parallel, part, device_type, fp32_weights)
    tokens = cfg.train.batch_size * cfg.data.seq_len
    ranges = stage_layer_ranges(model.num_hidden_layers, parallel.num_stages)
    stage_ids = part.stage_ids if isinstance(part, PipelineModel) else [0]
    if not isinstance(part, PipelineModel):
        ranges = [range(model.num_hidden_layers)]
    # Per micro-batch: per-token bytes times tokens, plus the layers' bf16 weight copies under autocast and the
    # stage's RoPE tables (which CPU offload moves to the host with the other saves).
    rope = 0 if cfg.memory.cpu_offload else rope_table_bytes(model) * tokens
    per_stage = [sum(act.layer(model.is_moe_layer(i)) * tokens + act.layer_weight_copies(model.is_moe_layer(i))
                     for i in ranges[s]) + rope for s in stage_ids]
    in_flight = in_flight_microbatches(parallel, pp_rank, cfg.train.grad_accum)
    held = in_flight * max(per_stage)
    head = act.head() * tokens + act.head_weight_copy()
    last = len(ranges) - 1
    if last in stage_ids and parallel.pp > 1 and parallel.pp_schedule == "interleaved_1f1b":
        # Every last-stage micro-batch in flight also holds its logits and loss saves; extra warm-up forwards
        # can run the last stage ahead of its backwards (with none, each is followed by its backward).
        actions = rank_actions(pp_rank, parallel.pp, len(stage_ids), cfg.train.grad_accum, parallel.pp_extra_warmup)
        held = peak_held(actions, lambda s: max(per_stage) + (head if s == last else 0.0))
    elif last in stage_ids:
        held += head  # the last stage's backward follows its forward: one micro-batch of logits
    recompute = max(act.recompute_transient(model.is_moe_layer(i)) for s in stage_ids for i in ranges[s])
    pipeline_buffers = 2 * 4 * tokens * model.hidden_size * len(stage_ids) if parallel.pp > 1 else 0
    return int(held), int(pipeline_buffers), int(recompute * tokens)


def plan(cfg: RunConfig, world: int | None = None, states: str | None = None, device_type: str = "cuda") -> dict:
    """Every rank's bytes (JSON-ready): world_size, max_rank_bytes, per_rank, and the layout used; `states`
    defaults to the config's `parallel.param_dtype` (float32 -> "fp32", bfloat16 -> "bf16")."""
    if states is None:
        states = "bf16" if cfg.parallel.param_dtype == "bfloat16" else "fp32"
    if states not in STATE_POLICIES:
        raise ValueError(f"states must be one of {sorted(STATE_POLICIES)}, got {states!r}")
    parallel = cfg.parallel
    if world is not None and world != parallel.world_size:
        model_parallel = parallel.pp * parallel.ep
        if world % model_parallel:
            raise ValueError(f"--world {world} is not a multiple of parallel.pp x ep = {model_parallel}")
        parallel = ParallelConfig(**{**asdict(parallel), "dp": world // model_parallel})
    by_pp = [plan_rank(cfg, parallel, p, states, device_type) for p in range(parallel.pp)]
    per_rank = []
    for rank in range(parallel.world_size):
        pp_rank, rest = divmod(rank, parallel.dp * parallel.ep)
        dp_rank, ep_rank = divmod(rest, parallel.ep)
        per_rank.append({**asdict(by_pp[pp_rank]), "rank": rank, "dp_rank": dp_rank, "ep_rank": ep_rank})
    worst = max(per_rank, key=lambda r: r["total_bytes"])
    return {"world_size": parallel.world_size, "layout": {"pp": parallel.pp, "dp": parallel.dp, "ep": parallel.ep,
                                                          "pp_virtual_stages": parallel.pp_virtual_stages,
                                                          "pp_schedule": parallel.pp_schedule, "shard": parallel.shard},
            "states": states, "device_type": device_type, "max_rank_bytes": worst["total_bytes"],
            "worst_rank": worst["rank"], "per_rank": per_rank}
