"""Greedy decode tok/s of openk2's Engine (latent cache, absorbed MLA) against HF generate, per batch and prompt.

The K2-shaped model (bf16 on CUDA, fp32 on the CPU dry run) and HF DeepseekV3 with its weights (SDPA) generate
the same `new_tokens` greedy tokens for the same random equal-length prompts. Timing follows
benchmarks/bench_infer.py, whose streamer and rate formulas are reused: each call is stamped at its start and
when each new token of the batch exists (ours: after each Engine.step, with the whole prompt batch prefilled in
step 1; HF: through a streamer, synchronised on CUDA), giving prefill seconds and decode tok/s =
batch x (N - 1) / (stamp N - stamp 1). One warm-up call each, then interleaved timed calls, medians. In bf16
greedy tokens may part ways where two logits are within rounding; the share of identical tokens is reported.
"""

from __future__ import annotations

import statistics
import time

import torch
from bench_infer import StampStreamer, rates, stamp

from openk2.infer.engine import Engine, SamplingParams

from .context import PartContext
from .sizes import bench_sizes
from .train import build_pair


class _SyncedStreamer(StampStreamer):
    """bench_infer's streamer, waiting for the device before each stamp."""

    def __init__(self, ctx: PartContext) -> None:
        super().__init__()
        self.ctx = ctx

    def put(self, value: torch.Tensor) -> None:
        self.ctx.sync()
        super().put(value)


def _ours(ctx: PartContext, model, prompts: list[list[int]], new: int) -> tuple[list[list[int]], list]:
    batch, plen = len(prompts), len(prompts[0])
    engine = Engine(model, max_batch_size=batch, max_seq_len=plen + new, max_prefill_tokens=batch * plen,
                    prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    stamps = [stamp()]
    order = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    results = []
    while engine.has_unfinished():
        results += engine.step()
        ctx.sync()
        stamps.append(stamp())
    results.sort(key=lambda r: order[r.request_id])
    return [r.token_ids for r in results], stamps


def _hf(ctx: PartContext, hf, ids: torch.Tensor, new: int) -> tuple[list[list[int]], list]:
    streamer = _SyncedStreamer(ctx)
    stamps = [stamp()]
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                          min_new_tokens=new, pad_token_id=0, streamer=streamer)
    return out[:, ids.shape[1]:].tolist(), stamps + streamer.stamps[1:]  # put #0 is the prompt


def _cell(ctx: PartContext, ours, hf, ids: torch.Tensor, repeats: int, new: int) -> dict | None:
    """One (batch, prompt) cell: warm-up calls, then `repeats` interleaved timed calls each; None if the time left
    after the warm-up cannot hold the timed calls."""
    batch, plen = ids.shape
    prompts, ids = ids.tolist(), ids.to(ctx.device)
    start = time.monotonic()
    calls = {"ours": lambda: _ours(ctx, ours, prompts, new), "hf": lambda: _hf(ctx, hf, ids, new)}
    first = {who: call() for who, call in calls.items()}  # warm-up; also the tokens compared
    if ctx.left() < repeats * (time.monotonic() - start) + 5:
        return None
    figures: dict[str, list[dict]] = {"ours": [], "hf": []}
    for rep in range(repeats):
        for who in (("ours", "hf") if rep % 2 == 0 else ("hf", "ours")):
            stamps = calls[who]()[1]
            if len(stamps) != new + 1:  # the formulas need [start, token 1, ..., token N]
                raise RuntimeError(f"{who}: {len(stamps) - 1} stamped steps for {new} tokens")
            figures[who].append(rates(stamps, batch))
    same = sum(a == b for x, y in zip(first["ours"][0], first["hf"][0], strict=True) for a, b in zip(x, y, strict=True))
    row = {"prompt": plen, "batch": batch}
    for who in ("ours", "hf"):
        row[f"{who} decode tok/s"] = statistics.median(f["wall_decode"] for f in figures[who])
        row[f"{who} prefill s"] = statistics.median(f["wall_prefill_s"] for f in figures[who])
    row["decode ours/HF"] = row["ours decode tok/s"] / row["hf decode tok/s"]
    row["same greedy tokens"] = f"{same / (batch * new):.1%}"
    return row


def run(ctx: PartContext) -> dict:
    """Every (prompt, batch) cell that fits in the part's time, shortest prompts first."""
    sizes = bench_sizes(ctx.quick)
    cfg = sizes.model
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    ours, hf = build_pair(ctx, cfg, dtype, "sdpa")
    ours.eval(), hf.eval()
    new, rows = sizes.new_tokens, []
    gen = torch.Generator().manual_seed(3)
    for plen in sizes.decode_prompts:
        for batch in sizes.decode_batches:
            ids = torch.randint(0, cfg.vocab_size, (batch, plen), generator=gen)
            try:
                row = _cell(ctx, ours, hf, ids, sizes.repeats, new)
            except Exception as err:  # noqa: BLE001 -- one cell (say HF out of memory at 64 x 4k) is not the part
                if ctx.device.type == "cuda":
                    torch.cuda.empty_cache()
                message = " ".join(str(err).split())[:120]
                row = {"prompt": plen, "batch": batch, "error": f"{type(err).__name__}: {message}"}
            if row is None:
                ctx.notes.append(f"batch {batch} x prompt {plen}: only the warm-up ran (part time running out)")
                continue
            rows.append(row)
            ctx.progress(f"prompt {plen} batch {batch}: " + (row.get("error") or f"ours {row['ours decode tok/s']:,.0f}"
                                                             f" tok/s, HF {row['hf decode tok/s']:,.0f} tok/s"))
    return {"status": "measured", "metrics": {
        "dtype": str(dtype), "new_tokens": new, "timed_calls_each": sizes.repeats,
        "hf_attn_implementation": hf.config._attn_implementation,
        "hf_experts_implementation": getattr(hf.config, "_experts_implementation", "?"),
        "ours": "Engine, absorbed MLA decode, whole prompt batch prefilled in one step, no prefix caching",
    }, "tables": {"decode (wall clock, medians)": rows}}
