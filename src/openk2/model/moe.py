"""Sparse MoE (DeepSeek-V3 / K2): sigmoid router with aux-loss-free balancing bias, routed experts held as
3-D weights and run with a grouped matmul over expert-sorted tokens, plus shared expert(s).

Shape legend: N tokens (B*T), D hidden, E routed experts, K experts per token, I expert width, G groups,
M (token, expert) rows (N*K), P rows once each expert's group is padded (aligned_rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from openk2.config import ModelConfig
from openk2.model.layers import MLP
from openk2.model.routing import FREE, RoutingTrace
from openk2.model.stats import ForwardStats

IDLE_SKIP_ROWS = 2  # below this many (token, expert) rows per expert on CPU, run only the experts that got rows
# bf16 on CPU: each expert's rows are padded (zero rows) to a multiple of this. oneDNN builds a kernel per matmul
# shape and caches 1,024; every per-expert row count x 6 matmul layouts overflowed it, so kernels were rebuilt
# every step. 16 measured best of 16/32/64 (benchmarks/bench_experts.py, docs/benchmarks.md).
CPU_ALIGN_ROWS = 16


@dataclass
class Routing:
    """The router's decision for N tokens."""

    indices_NK: torch.Tensor  # chosen experts
    weights_NK: torch.Tensor  # fp32 combine weights (normalised, scaled)
    scores_NE: torch.Tensor  # fp32 sigmoid affinities (no bias)
    chosen_NK: torch.Tensor | None = None  # the router's own top-k when indices_NK were replayed (else None)


class Router(nn.Module):
    """Sigmoid scores in fp32; the correction bias only changes which experts are selected, never the weights."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        # Updated outside autograd by the trainer (aux-loss-free balancing), saved in checkpoints.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x_ND: torch.Tensor, replay_NK: torch.Tensor | None = None) -> Routing:
        """Route N tokens; `replay_NK` (R3, see routing.py) imposes experts on the tokens whose row holds no
        FREE entry, their weights still computed from these scores (so the router gets gradients)."""
        with torch.autocast(device_type=x_ND.device.type, enabled=False):
            scores = F.linear(x_ND.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            biased = self._mask_groups(biased)
        indices = chosen = biased.topk(self.top_k, dim=-1, sorted=False).indices
        if replay_NK is not None:
            indices = torch.where((replay_NK != FREE).all(-1, keepdim=True), replay_NK, chosen)
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(indices, weights * self.routed_scaling_factor, scores,
                       chosen if replay_NK is not None else None)

    def _mask_groups(self, biased_NE: torch.Tensor) -> torch.Tensor:
        # DeepSeek-V3 node-limited routing: a group's score is the sum of its top-2 biased scores.
        n = biased_NE.shape[0]
        grouped = biased_NE.view(n, self.n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        keep = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        return grouped.masked_fill(~group_mask[..., None], float("-inf")).view(n, -1)


def grouped_linear(x_MI: torch.Tensor, w_EOI: torch.Tensor, offsets: torch.Tensor, use_grouped_mm: bool):
    """Rows of x sorted by expert (offsets [E] int32 = cumulative row ends) times each expert's W^T."""
    w_EIO = w_EOI.transpose(1, 2)
    # torch.compile traces grouped_mm through a shape function that accepts bf16 only (CPU eager runs any
    # dtype), so compiled blocks in other dtypes take the exact per-expert fallback below.
    if use_grouped_mm and (x_MI.dtype == torch.bfloat16 or not torch.compiler.is_compiling()):
        return F.grouped_mm(x_MI, w_EIO.to(x_MI.dtype), offs=offsets)
    # Exact fallback: one matmul per expert over its contiguous slice of rows; idle experts cost nothing.
    outs, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            outs.append(x_MI[start:end] @ w_EIO[e].to(x_MI.dtype))
        start = end
    return torch.cat(outs, dim=0) if outs else x_MI.new_zeros(0, w_EIO.shape[-1])


def aligns_rows(x_ND: torch.Tensor, dtype: torch.dtype, rows: int, experts: int) -> bool:
    """Whether the experts pad their `rows` (token, expert) rows to CPU_ALIGN_ROWS (`pads_expert_rows`)."""
    return pads_expert_rows(x_ND.device.type, dtype, rows, experts)


def pads_expert_rows(device_type: str, dtype: torch.dtype, rows: int, experts: int) -> bool:
    """`aligns_rows` on shapes (the memory plan asks it too): bf16 on CPU, eager or compiled (oneDNN's per-shape
    kernels; fp32 measured 0.92x aligned), with at least IDLE_SKIP_ROWS rows per expert (fewer run only the
    active experts)."""
    return device_type == "cpu" and dtype == torch.bfloat16 and rows >= experts * IDLE_SKIP_ROWS


def aligned_rows(experts_M: torch.Tensor, token_of_row: torch.Tensor, counts_E: torch.Tensor, pad_token: int,
                 align: int | None = None, static: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expert-sorted rows (experts_M [M] non-decreasing, token_of_row [M]) laid out with each expert's group
    padded to a multiple of `align` (CPU_ALIGN_ROWS): the token of each padded row [P] (`pad_token` for
    padding), each sorted row's padded position [M], and the padded groups' row ends [E] (int32).

    `static` (compiled blocks): P is the bound M + E*(align-1) rounded down to a multiple of align, whatever the
    routing, and the last group takes the slack as padding rows, so no shape depends on the data (no host read,
    no recompile). The slack (~E*(align-1)/2 zero rows on average) is extra work for the last expert, measured a
    net win under compile (docs/benchmarks.md); eager reads the exact total and pads no more than each group needs."""
    align = CPU_ALIGN_ROWS if align is None else align
    padding_E = (-counts_E) % align
    ends_E = (counts_E + padding_E).cumsum(0)
    # A row moves down by the padding of the groups before its own: the exclusive cumsum of padding_E.
    shift_E = padding_E.cumsum(0) - padding_E
    dest_M = torch.arange(experts_M.shape[0], device=experts_M.device) + shift_E[experts_M]
    if static:
        # Every group's padded end is a multiple of align and at most the bound, so the last one fits under P.
        total = (experts_M.shape[0] + counts_E.shape[0] * (align - 1)) // align * align
        ends_E = torch.cat((ends_E[:-1], ends_E.new_full((1,), total)))
    else:
        total = int(ends_E[-1]) if ends_E.numel() else 0  # a host read: this layout is CPU-only
    rows_P = torch.full((total,), pad_token, dtype=token_of_row.dtype, device=token_of_row.device)
    return rows_P.index_copy_(0, dest_M, token_of_row), dest_M, ends_E.to(torch.int32)


class RoutedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: gate_proj/up_proj [E, I, D], down_proj [E, D, I]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(e, i, d))
        self.up_proj = nn.Parameter(torch.empty(e, i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.use_grouped_mm = hasattr(F, "grouped_mm")

    def swiglu(self, x_MD: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (offsets [E] int32 = cumulative row ends) through their experts' SwiGLU."""
        gate = grouped_linear(x_MD, self.gate_proj, offsets, self.use_grouped_mm)
        up = grouped_linear(x_MD, self.up_proj, offsets, self.use_grouped_mm)
        return grouped_linear(F.silu(gate) * up, self.down_proj, offsets, self.use_grouped_mm)

    def active_swiglu(self, x_MD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """`swiglu` over only the experts that received rows: their weights are gathered into a smaller
        grouped matmul, so idle experts cost neither a group nor a weight read (the same products per row)."""
        active = counts_E.nonzero().squeeze(1)
        offsets = counts_E[active].cumsum(0).to(torch.int32)

        def linear(x: torch.Tensor, w_EOI: torch.Tensor) -> torch.Tensor:
            return grouped_linear(x, w_EOI.index_select(0, active), offsets, self.use_grouped_mm)

        return linear(F.silu(linear(x_MD, self.gate_proj)) * linear(x_MD, self.up_proj), self.down_proj)

    def forward(self, x_ND: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the combined expert output [N, D] and tokens per expert [E]."""
        n, k = routing.indices_NK.shape
        flat_experts = routing.indices_NK.reshape(-1)
        order = flat_experts.argsort(stable=True)  # (token, slot) pairs grouped by expert
        token_of_row = order // k
        # Not bincount: its output size depends on the data (a host sync on GPU, a graph break under compile);
        # every index is < E, so a scatter-add into E slots gives the same counts with a static shape.
        counts_E = torch.zeros(self.gate_proj.shape[0], dtype=torch.int64, device=flat_experts.device)
        counts_E.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
        offsets = counts_E.cumsum(0).to(torch.int32)
        # The device's own autocast: is_autocast_enabled() without a device type reads CUDA's only.
        on = torch.is_autocast_enabled(x_ND.device.type)
        dtype = torch.get_autocast_dtype(x_ND.device.type) if on else x_ND.dtype
        if self.use_grouped_mm and aligns_rows(x_ND, dtype, n * k, counts_E.numel()):
            return self._aligned_forward(x_ND.to(dtype), routing, order, token_of_row, counts_E), counts_E
        # index_select, not x_ND[token_of_row]: its backward is one index_add, not a sorting index_put.
        x_MD = x_ND.index_select(0, token_of_row).to(dtype)
        if self.use_grouped_mm and x_MD.device.type == "cpu" and 0 < n * k < counts_E.numel() * IDLE_SKIP_ROWS:
            # Few rows (decode): many experts are idle and CPU grouped_mm pays per group; on GPU the grouped
            # kernel skips empty groups itself, and finding the idle ones would cost a device sync.
            y_MD = self.active_swiglu(x_MD, counts_E)
        else:
            y_MD = self.swiglu(x_MD, offsets)
        y_MD = y_MD * routing.weights_NK.reshape(-1)[order, None].to(y_MD.dtype)
        out = torch.zeros(n, y_MD.shape[-1], dtype=y_MD.dtype, device=y_MD.device)
        return out.index_add_(0, token_of_row, y_MD), counts_E

    def _aligned_forward(self, x_ND: torch.Tensor, routing: Routing, order: torch.Tensor, token_of_row: torch.Tensor,
                         counts_E: torch.Tensor) -> torch.Tensor:
        """`forward`'s combined output with each expert's rows padded to CPU_ALIGN_ROWS: padding rows read an
        appended zero row and are summed into a dropped one, so every real row's products are unchanged."""
        n, d = x_ND.shape
        rows_P, dest_M, offsets = aligned_rows(routing.indices_NK.reshape(-1)[order], token_of_row, counts_E, n,
                                               static=torch.compiler.is_compiling())
        x_PD = torch.cat((x_ND, x_ND.new_zeros(1, d))).index_select(0, rows_P)
        y_PD = self.swiglu(x_PD, offsets)
        # A padding row's output is exactly zero (zero input) and so is its weight: it adds 0 to the dropped row n.
        weights_M = routing.weights_NK.reshape(-1)[order]
        weights_P = weights_M.new_zeros(rows_P.shape[0]).scatter(0, dest_M, weights_M)
        y_PD = y_PD * weights_P[:, None].to(y_PD.dtype)
        out = torch.zeros(n + 1, d, dtype=y_PD.dtype, device=y_PD.device)
        return out.index_add_(0, rows_P, y_PD)[:n]

    def begin(self, x_ND: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """Tokens per expert [E] now and a `finish()` giving the combined output [N, D]: what the caller runs
        in between overlaps the experts' token exchange where there is one (expert parallelism); here it is all
        computed before returning."""
        out, counts_E = self(x_ND, routing)
        return counts_E, lambda: out


class MoE(nn.Module):
    """Routed experts + shared expert(s); reports tokens per expert (and the balance loss) to a caller's stats."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.aux_loss_alpha = cfg.aux_loss_alpha
        self.top_k = cfg.num_experts_per_tok

    def route(self, x_ND: torch.Tensor, trace: RoutingTrace | None = None) -> Routing:
        """The router's choice for N tokens; with a `trace`, replaying its imposed experts and recording both."""
        if trace is None:
            return self.gate(x_ND)
        routing = self.gate(x_ND, trace.replay_for(self.layer_idx, x_ND.shape[0], x_ND.device))
        chosen = routing.indices_NK if routing.chosen_NK is None else routing.chosen_NK
        trace.record(self.layer_idx, routing.indices_NK, chosen)
        return routing

    def forward(self, x_BTD: torch.Tensor, stats: ForwardStats | None = None,
                trace: RoutingTrace | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; `stats` receives this call's tokens per expert and balance loss, `trace`
        (a caller's RoutingTrace) records the experts chosen and may replay given ones."""
        b, t, d = x_BTD.shape
        x_ND = x_BTD.reshape(-1, d)
        routing = self.route(x_ND, trace)
        counts_E, finish_routed = self.experts.begin(x_ND, routing)
        # From here to finish_routed() nothing depends on the routed experts, so under expert parallelism it runs
        # while their tokens travel. Computed whenever it applies, recorded or not: a recomputation's replay
        # (stats=None) must run the forward's ops exactly.
        aux_loss = self._sequence_aux_loss(routing, b, t) if self.training and self.aux_loss_alpha else None
        if stats is not None:
            stats.record_routing(self.layer_idx, counts_E, aux_loss)
        shared = self.shared_experts(x_BTD)
        return finish_routed().view(b, t, d).to(x_BTD.dtype) + shared

    def _sequence_aux_loss(self, routing: Routing, b: int, t: int) -> torch.Tensor:
        # DeepSeek-V3 eq. 17-20: alpha * sum_i f_i * P_i per sequence, f_i = E/(K*T) * (tokens choosing i),
        # P_i = mean over tokens of the normalised affinity s_i / sum_j s_j; averaged over sequences.
        e = routing.scores_NE.shape[-1]
        probs = routing.scores_NE / routing.scores_NE.sum(dim=-1, keepdim=True)
        chosen = torch.zeros_like(probs).scatter_(1, routing.indices_NK, 1.0)
        f_BE = chosen.view(b, t, e).sum(1) * (e / (self.top_k * t))
        p_BE = probs.view(b, t, e).mean(1)
        return self.aux_loss_alpha * (f_BE * p_BE).sum(-1).mean()

    @torch.no_grad()
    def update_bias(self, rate: float, counts_E: torch.Tensor) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones, by `rate`."""
        bias = self.gate.e_score_correction_bias
        bias += rate * torch.sign(counts_E.float().mean() - counts_E.float()).to(bias.dtype)
