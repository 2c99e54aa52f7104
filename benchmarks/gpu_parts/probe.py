"""Cost of QK-Clip's max-logit probe on the part's device, at the attention core and in a whole training step.

Core: q, k [1, H, T, 192], v [1, H, T, 128] (K2's head dims), H = the K2-shaped config's heads; `attend` alone
against `attend_with_max` (on CUDA: attend + the blockwise `head_max_logits`), forward and forward+backward,
timed interleaved by benchmarks/bench_probe.py's helper. Step: the K2-shaped config cut to 2 layers (1 dense,
1 MoE), batch 1, one training step with `ForwardStats(track_max_logits=True)` against False. bf16 on CUDA.
"""

from __future__ import annotations

import time

import torch
from bench_probe import QK_DIM, V_DIM, _interleaved

from openk2 import K2ForCausalLM
from openk2.model import ForwardStats
from openk2.model.attention_core import attend, attend_with_max

from .context import PartContext
from .sizes import bench_sizes


def core_row(ctx: PartContext, t: int, heads: int, dtype: torch.dtype, repeats: int) -> dict:
    """Probe overhead on the attention core at length t."""
    g = torch.Generator().manual_seed(t)
    q, k = (torch.randn(1, heads, t, QK_DIM, generator=g).to(ctx.device, dtype).requires_grad_() for _ in range(2))
    v = torch.randn(1, heads, t, V_DIM, generator=g).to(ctx.device, dtype).requires_grad_()
    scale = QK_DIM ** -0.5

    def core(probe: bool) -> torch.Tensor:
        return attend_with_max(q, k, v, scale)[0] if probe else attend(q, k, v, scale)

    def fwd(probe: bool) -> None:
        with torch.no_grad():
            core(probe)

    def step(probe: bool) -> None:
        core(probe).sum().backward()
        q.grad = k.grad = v.grad = None

    f = _interleaved({"off": lambda: fwd(False), "on": lambda: fwd(True)}, repeats)
    s = _interleaved({"off": lambda: step(False), "on": lambda: step(True)}, repeats)
    return {"what": "core", "tokens": t, "heads": heads, "fwd ms off": f["off"] * 1e3, "fwd ms probe": f["on"] * 1e3,
            "fwd overhead": f"{f['on'] / f['off'] - 1:+.1%}", "fwd+bwd ms off": s["off"] * 1e3,
            "fwd+bwd ms probe": s["on"] * 1e3, "fwd+bwd overhead": f"{s['on'] / s['off'] - 1:+.1%}"}


def step_row(ctx: PartContext, model: K2ForCausalLM, t: int, repeats: int) -> dict:
    """Probe overhead on one training step of `model` at batch 1 x t tokens."""
    ids = torch.randint(0, model.config.vocab_size, (1, t), generator=torch.Generator().manual_seed(t))
    ids = ids.to(ctx.device)

    def step(track: bool) -> None:
        stats = ForwardStats(model.config, track_max_logits=track)
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids, stats=stats).loss.backward()
        stats.max_logits()

    s = _interleaved({"off": lambda: step(False), "on": lambda: step(True)}, repeats)
    return {"what": "2-layer step", "tokens": t, "heads": model.config.num_attention_heads,
            "fwd+bwd ms off": s["off"] * 1e3, "fwd+bwd ms probe": s["on"] * 1e3,
            "fwd+bwd overhead": f"{s['on'] / s['off'] - 1:+.1%}"}


def run(ctx: PartContext) -> dict:
    """Core rows per length, then step rows per length while the part's time lasts."""
    sizes = bench_sizes(ctx.quick)
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    repeats = sizes.repeats + 2
    rows = []
    for t in sizes.probe_lengths:
        rows.append(core_row(ctx, t, sizes.probe_heads, dtype, repeats))
        ctx.progress(f"core T={t}: {rows[-1]['fwd+bwd overhead']} fwd+bwd")
    cfg = sizes.model.replace(num_hidden_layers=2)
    model = K2ForCausalLM(cfg, init_seed=0).to(dtype).to(ctx.device).train()
    last = 0.0
    for t in sizes.probe_lengths:
        if ctx.left() < 4 * last + 5:  # the next row is longer than the last (4x the tokens at most)
            ctx.notes.append(f"step row at {t} tokens left out: the part's time was running out")
            continue
        start = time.monotonic()
        rows.append(step_row(ctx, model, t, repeats))
        last = time.monotonic() - start
        ctx.progress(f"step T={t}: {rows[-1]['fwd+bwd overhead']}")
    how = ("one fused pass (probed_attention)" if ctx.device.type == "cpu"
           else "attend + blockwise head_max_logits (fp32 logits)")
    return {"status": "measured", "metrics": {"dtype": str(dtype), "repeats": repeats, "probe": how},
            "tables": {"probe overhead (median ms, interleaved)": rows}}
