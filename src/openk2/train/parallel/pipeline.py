"""Pipeline parallelism: the K2 layer stack cut into pp x pp_virtual_stages stages, run by a
`torch.distributed.pipelining` schedule (interleaved 1F1B by default, as in the K2 report, section 2.4).

Stage s holds a contiguous run of decoder layers; stage 0 also embeds the tokens and the last stage also
applies the final norm and lm_head, so the loss is computed on the last stage. With v virtual stages, pipeline
rank p holds stages p, p + pp, ..., p + (v-1) pp ("loop" placement, what the interleaved schedules expect);
the zero-bubble V schedule (zbv_zero_bubble) holds stages p and 2 pp - 1 - p instead.
With parallel.pp_extra_warmup > 0, interleaved 1F1B runs that many more warm-up forwards per rank
(warmup_schedule.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from openk2.model import ForwardStats, K2ForCausalLM
from openk2.model.moe import MoE
from openk2.train.parallel.config import PP_SCHEDULES, SINGLE_STAGE_SCHEDULES, ParallelConfig
from openk2.train.parallel.mesh import ParallelMesh
from openk2.train.parallel.warmup_schedule import ScheduleInterleaved1F1BExtraWarmup


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous decoder-layer ranges per stage, as even as possible (earlier stages take the remainder)."""
    if num_layers < num_stages:
        raise ValueError(f"model.num_hidden_layers={num_layers} is smaller than parallel.pp x pp_virtual_stages "
                         f"= {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    starts = [0]
    for s in range(num_stages):
        starts.append(starts[-1] + base + (1 if s < extra else 0))
    return [range(starts[s], starts[s + 1]) for s in range(num_stages)]


def stages_of_rank(config: ParallelConfig, pp_rank: int) -> list[int]:
    """The global stage indices pipeline rank `pp_rank` runs, in the order the schedule expects."""
    if config.pp_schedule == "zbv_zero_bubble":
        return [pp_rank, 2 * config.pp - 1 - pp_rank]
    return [pp_rank + k * config.pp for k in range(config.pp_virtual_stages)]


class _AuxLossGrad(torch.autograd.Function):
    """Identity on a stage's output whose backward also starts the backward of the stage's sequence-wise aux loss
    with gradient `weight` (the loss never reaches the last stage; its gradient rides the activation gradient)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype, ctx.weight = aux.shape, aux.dtype, weight
        # A copy, not a view: the pipeline's input-gradient pass detaches stage outputs in place. The input is
        # not saved, so the copy replaces it rather than adding to what backward holds.
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.weight, dtype=ctx.aux_dtype, device=grad.device), None


class StageModule(nn.Module):
    """Decoder layers `layer_ids` of `model`, plus the embedding (first stage) or final norm + lm_head (last).

    The MoE layers' sequence-wise aux loss (model.aux_loss_alpha > 0) is added to the training objective with
    weight `aux_weight` (the micro-batch's share of the step's rows, set by the trainer) through `_AuxLossGrad`;
    its weighted value is summed into `aux_value` for logging."""

    def __init__(self, model: K2ForCausalLM, layer_ids: range, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.layer_ids = layer_ids
        self.aux_weight = 1.0
        self.aux_value = torch.zeros(())
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[i] for i in layer_ids)
        self.rotary_emb = model.model.rotary_emb
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None
        # The caller's collector while PipelineModel.recording() is active: the schedule calls stages with
        # tensors only, so the reference rides here for the duration of that block and nowhere else.
        self.stats: ForwardStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] (first stage) or hidden [B, T, D] -> hidden [B, T, D] or logits [B, T, V] (last)."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        b, t = x.shape[:2]
        cos, sin = self.rotary_emb(torch.arange(t, device=x.device).expand(b, t))
        # This call's own collector: its aux loss (graph kept) is this stage's share of the objective.
        call = ForwardStats(self.config) if self.stats is None else self.stats.empty_like()
        for layer in self.layers:
            x = layer(x, cos, sin, stats=call)  # the model's own DecoderLayer
        aux = call.aux_loss()
        if self.stats is not None:
            self.stats.merge(call)
        if aux is not None and torch.is_grad_enabled():  # before lm_head: the copy is [B, T, D], not [B, T, V]
            self.aux_value = self.aux_value.to(aux.device) + aux.detach().float() * self.aux_weight
            x = _AuxLossGrad.apply(x, aux, self.aux_weight)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


class PipelineModel(nn.Module):
    """This rank's stages of a K2ForCausalLM, with the model-level hooks the trainer and MuonClip use."""

    def __init__(self, model: K2ForCausalLM, mesh: ParallelMesh) -> None:
        super().__init__()
        cfg = mesh.config
        if model.config.tie_word_embeddings:
            raise ValueError("pipeline parallelism does not support tie_word_embeddings (embedding and lm_head "
                             "live on different stages)")
        self.config = model.config
        self.num_stages = cfg.num_stages
        ranges = stage_layer_ranges(model.config.num_hidden_layers, self.num_stages)
        self.stage_ids = stages_of_rank(cfg, mesh.pp_rank)
        self.stages = nn.ModuleList(
            StageModule(model, ranges[s], first=s == 0, last=s == self.num_stages - 1) for s in self.stage_ids)
        self.layer_ids = sorted(i for s in self.stage_ids for i in ranges[s])
        # Checkpoints and optimizer filters use the full model's names for the tensors this rank keeps.
        full_names = {id(t): n for n, t in model.state_dict(keep_vars=True).items()}
        self.full_names = {n: full_names[id(t)] for n, t in self.state_dict(keep_vars=True).items()}
        moe_ordinal = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, MoE)]
        self.moe_rows = {moe_ordinal.index(i): model.model.layers[i].mlp for i in self.layer_ids
                         if isinstance(model.model.layers[i].mlp, MoE)}
        self.num_moe_layers = len(moe_ordinal)
        self.attention = {i: model.model.layers[i].self_attn for i in self.layer_ids}

    @property
    def stream_dtype(self) -> torch.dtype:
        """The residual stream's dtype between stages: fp32 (autocast keeps it so over fp32 weights), or the
        weights' dtype when they are bf16 (the embedding then yields bf16 and every layer keeps it)."""
        dtype = next(self.parameters()).dtype
        return dtype if dtype != torch.float32 else torch.float32

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def named_full_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(full-model name, parameter) for every parameter this rank holds (each once)."""
        return [(self.full_names[n], p) for n, p in self.named_parameters()]

    def full_state_dict_part(self) -> dict[str, torch.Tensor]:
        """This rank's share of the full model's state dict, under the full model's names."""
        return {self.full_names[n]: t for n, t in self.state_dict().items()}

    # ------------------------------------------------------------------ model hooks (K2ForCausalLM's API)
    def attention_layers(self) -> list[nn.Module]:
        return list(self.attention.values())

    @contextmanager
    def recording(self, stats: ForwardStats | None) -> Iterator[None]:
        """Stage forwards inside the block record into `stats` (this rank's layers only: its other rows stay
        zero counts and -inf max logits, for the cross-rank reductions to fill)."""
        for stage in self.stages:
            stage.stats = stats
            stage.aux_value = torch.zeros(())
        try:
            yield
        finally:
            for stage in self.stages:
                stage.stats = None

    def set_aux_weight(self, weight: float) -> None:
        """The weight of each micro-batch's aux loss in the step's objective (its share of the step's rows)."""
        for stage in self.stages:
            stage.aux_weight = weight

    def recorded_aux_loss(self) -> float:
        """The weighted aux losses this rank's stages added during the last `recording` block."""
        return float(sum(float(stage.aux_value) for stage in self.stages))

    @torch.no_grad()
    def update_router_biases(self, tokens_per_expert: torch.Tensor, rate: float | None = None) -> None:
        """Aux-loss-free balancing of this rank's MoE layers from the global counts [num_moe_layers, E]."""
        rate = self.config.bias_update_rate if rate is None else rate
        for row, moe in self.moe_rows.items():
            moe.update_bias(rate, tokens_per_expert[row])


def build_schedule(
    model: PipelineModel,
    mesh: ParallelMesh,
    microbatch_shape: tuple[int, int],
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    logits_dtype: torch.dtype = torch.float32,
):
    """The configured torch.distributed.pipelining schedule over this rank's stages.

    `microbatch_shape` is (rows, seq_len) of one micro-batch. `loss_fn(logits, labels)` must already carry the
    micro-batch's share of the step's normalisation (the schedule is built with scale_grads=False, so
    gradients are summed over micro-batches as they are).
    """
    cfg = mesh.config
    stages = []
    for module, s in zip(model.stages, model.stage_ids, strict=True):
        # Static shapes: with none given, the stage would infer them by running a forward on its first
        # micro-batch, which would also count that micro-batch's routed tokens and attention logits twice.
        inputs, outputs = _stage_io(model, s, microbatch_shape, device, logits_dtype)
        stages.append(pipelining.PipelineStage(module, s, model.num_stages, device, input_args=inputs,
                                               output_args=outputs, group=mesh.group("pp")))
    schedule_cls = getattr(pipelining, PP_SCHEDULES[cfg.pp_schedule])
    if cfg.pp_schedule in SINGLE_STAGE_SCHEDULES:
        return schedule_cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
    if cfg.pp_extra_warmup:  # interleaved_1f1b only (config.py): the report's extra warm-up micro-batches
        return ScheduleInterleaved1F1BExtraWarmup(stages, num_microbatches, extra_warmup=cfg.pp_extra_warmup,
                                                  loss_fn=loss_fn, scale_grads=False)
    return schedule_cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)


def _stage_io(model: PipelineModel, stage: int, shape: tuple[int, int], device: torch.device,
              logits_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Example input and output of one stage: token ids or the fp32 residual stream in, stream or logits out."""
    rows, seq = shape
    # requires_grad marks what carries a gradient back (the schedule derives the gradient buffers from it).
    hidden = torch.empty(rows, seq, model.config.hidden_size, dtype=model.stream_dtype, device=device,
                         requires_grad=True)
    first, last = stage == 0, stage == model.num_stages - 1
    inputs = torch.zeros(rows, seq, dtype=torch.long, device=device) if first else hidden
    outputs = (torch.empty(rows, seq, model.config.vocab_size, dtype=logits_dtype, device=device, requires_grad=True)
               if last else hidden)
    return inputs, outputs


def rank_of_stage(config: ParallelConfig, stage: int) -> int:
    """The pipeline rank that runs global stage `stage` (inverse of stages_of_rank)."""
    if config.pp_schedule == "zbv_zero_bubble":
        return stage if stage < config.pp else 2 * config.pp - 1 - stage
    return stage % config.pp


@torch.no_grad()
def pipeline_forward(model: PipelineModel, mesh: ParallelMesh, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Forward-only pass, one stage after another (no micro-batches, no overlap): logits on the rank that holds
    the last stage, None elsewhere. Used for validation, where throughput does not matter."""
    cfg, group = mesh.config, mesh.group("pp")
    b, t = input_ids.shape
    hidden = None
    for s in range(model.num_stages):
        here, before = rank_of_stage(cfg, s), rank_of_stage(cfg, s - 1) if s else None
        if here != mesh.pp_rank:
            continue
        if s == 0:
            hidden = input_ids
        elif before != mesh.pp_rank:
            hidden = torch.empty(b, t, model.config.hidden_size, dtype=model.stream_dtype, device=input_ids.device)
            dist.recv(hidden, group=group, group_src=before)
        hidden = model.stages[model.stage_ids.index(s)](hidden)
        after = rank_of_stage(cfg, s + 1) if s + 1 < model.num_stages else None
        if after is not None and after != mesh.pp_rank:
            dist.send(hidden.to(model.stream_dtype).contiguous(), group=group, group_dst=after)
    return hidden if model.has_last_stage else None
