"""Train step tok/s and MFU of ours against HF DeepseekV3 at the K2-shaped config, and the SDPA kernels each ran.

One training step = zero grads, forward with labels, backward (no optimizer), as benchmarks/bench_model.py
times it, whose step function, HF loader conventions and experts-implementation list are reused. On CUDA both
models run in bf16 (parameters cast, no autocast); on the CPU dry run in fp32. HF gets attn_implementation="sdpa"
and the fastest experts implementation that runs here (each tried for one step). The two models alternate step
by step; the figure is the median step after two warm-ups.

MFU = ours tok/s x training FLOPs per token (openk2.train.flops) / peak, against the datasheet's dense bf16 peak
where the device is listed, and against the bf16 matmul ceiling measured in this part.
"""

from __future__ import annotations

import statistics
import time

import torch
from bench_model import experts_candidates, hf_step_kwargs, train_step
from common import hf_copy, quiet_transformers

from openk2 import K2ForCausalLM
from openk2.train.flops import measure_matmul_peak, training_flops_per_token

from .context import PartContext, PartSkipped
from .sizes import bench_sizes, datasheet_peak

WARMUP, MAX_TIMED = 2, 10  # untimed pairs of steps, most timed pairs
RESERVE_S = 10.0  # part time kept for the matmul ceiling and the report
SDPA_OPS = ("flash_attention", "efficient_attention", "cudnn_attention", "attention_math", "scaled_dot_product")


def sdpa_kernels(step) -> dict[str, int]:
    """Calls per attention op (aten names) in one run of `step`, from the profiler: which SDPA kernel ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return {e.key: e.count for e in prof.key_averages() if any(op in e.key for op in SDPA_OPS)}


_built: dict[tuple, tuple[K2ForCausalLM, torch.nn.Module]] = {}  # the last pair, for the next part in this worker


def build_pair(ctx: PartContext, cfg, dtype: torch.dtype, attn: str) -> tuple[K2ForCausalLM, torch.nn.Module]:
    """Ours on the device in `dtype`, and HF DeepseekV3 holding the same weights (via a temporary checkpoint).
    The pair is kept for a later part of the same worker (decode after train_step saves a rebuild)."""
    key = (repr(cfg), dtype, attn, str(ctx.device))
    if key in _built:
        ctx.progress("reusing the model pair an earlier part built")
        return _built[key]
    _built.clear()
    try:
        quiet_transformers()
    except ImportError as err:
        raise PartSkipped(f"transformers is not installed ({err})") from err
    started = time.monotonic()
    # Built on the CPU and moved: the weights are drawn on the CPU anyway (model/init.py), and the cast before
    # the move halves what crosses to the device.
    ours = K2ForCausalLM(cfg, init_seed=0).to(dtype).to(ctx.device).train()
    kwargs = {"attn_implementation": attn}
    if ctx.device.type == "cuda":
        kwargs["device_map"] = str(ctx.device)
    hf = hf_copy(ours, **kwargs).to(ctx.device, dtype)
    ctx.progress(f"built ours and HF ({sum(p.numel() for p in ours.parameters()) / 1e6:,.1f}M params each, "
                 f"{str(dtype).removeprefix('torch.')}) in {time.monotonic() - started:.0f} s")
    _built[key] = (ours, hf)
    return ours, hf


def pick_experts(ctx: PartContext, hf, ids: torch.Tensor) -> tuple[str, dict[str, str]]:
    """The fastest HF experts implementation on one step (after one warm-up each); a report of each one."""
    try:
        candidates, skipped = experts_candidates()
    except ImportError as err:  # an older transformers: one implementation, nothing to choose
        return "default", {"default": f"no experts implementations to choose from ({err})"}
    if not hasattr(hf, "set_experts_implementation"):
        return "default", {"default": "this transformers has no set_experts_implementation"}
    report = {k: "skipped (CUDA only)" for k in skipped}
    times = {}
    for impl in candidates:
        try:
            hf.set_experts_implementation(impl)
            train_step(hf, ids, **hf_step_kwargs())
            ctx.sync()
            start = time.perf_counter()
            train_step(hf, ids, **hf_step_kwargs())
            ctx.sync()
            times[impl] = time.perf_counter() - start
            report[impl] = f"{times[impl] * 1e3:.1f} ms/step"
        except Exception as err:  # noqa: BLE001 -- e.g. a kernel from the Hub, which cannot be fetched here
            hf.zero_grad(set_to_none=True)
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()  # after an out-of-memory error
            report[impl] = f"unavailable ({type(err).__name__}: {' '.join(str(err).split())[:80]})"
    if not times:
        raise RuntimeError(f"no HF experts implementation ran: {report}")
    return min(times, key=times.get), report


def run(ctx: PartContext) -> dict:
    """Time both models' training step; report tok/s, MFU, peak memory and the attention kernels."""
    sizes = bench_sizes(ctx.quick)
    cfg, cuda = sizes.model, ctx.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    ours, hf = build_pair(ctx, cfg, dtype, "sdpa")
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (sizes.batch, sizes.seq_len), generator=gen).to(ctx.device)
               for _ in range(4)]
    experts, experts_report = pick_experts(ctx, hf, batches[0])
    if experts != "default":
        hf.set_experts_implementation(experts)
    ctx.progress(f"HF experts_implementation={experts}: {experts_report}")

    steps = {"ours": lambda ids: train_step(ours, ids), "hf": lambda ids: train_step(hf, ids, **hf_step_kwargs())}
    losses = {who: step(batches[0]) for who, step in steps.items()}
    peak_mem, kernels = {}, {}
    for who, step in steps.items():
        if cuda:
            (ours if who == "ours" else hf).zero_grad(set_to_none=True)
            before = torch.cuda.memory_allocated(ctx.device)
            torch.cuda.reset_peak_memory_stats(ctx.device)
        kernels[who] = sdpa_kernels(lambda step=step: step(batches[1]))
        if cuda:
            peak_mem[who] = (torch.cuda.max_memory_allocated(ctx.device) - before) / 2**30
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    pair = 0.0  # seconds of the last pair of steps
    for i in range(WARMUP + MAX_TIMED):
        timed = i - WARMUP
        if timed >= 2 and (ctx.left() < 2 * pair + RESERVE_S or (timed >= sizes.repeats and pair * timed > 30)):
            break  # enough steps for a median, and the part's time is needed for the ceiling and the report
        start_pair = time.perf_counter()
        for who in (("ours", "hf") if i % 2 == 0 else ("hf", "ours")):
            ctx.sync()
            start = time.perf_counter()
            steps[who](batches[i % len(batches)])
            ctx.sync()
            if timed >= 0:
                times[who].append(time.perf_counter() - start)
        pair = time.perf_counter() - start_pair

    tokens = sizes.batch * sizes.seq_len
    flops_tok = training_flops_per_token(cfg, sizes.seq_len)
    ceiling = measure_matmul_peak(dtype, device=str(ctx.device), size=256 if ctx.quick else 8192, repeats=10)
    peak, peak_source = datasheet_peak(torch.cuda.get_device_name(ctx.device)) if cuda else (None, "CPU: none")
    rows = []
    for who in ("ours", "hf"):
        tps = tokens / statistics.median(times[who])
        row = {"model": who, "tok/s": tps, "step ms (median)": statistics.median(times[who]) * 1e3,
               "step ms range": f"{min(times[who]) * 1e3:.1f}-{max(times[who]) * 1e3:.1f}",
               "TFLOP/s": tps * flops_tok / 1e12, "MFU vs matmul ceiling": f"{tps * flops_tok / ceiling:.1%}",
               "MFU vs datasheet": f"{tps * flops_tok / peak:.1%}" if peak else "n/a",
               "loss batch 0": losses[who], "attention ops": ", ".join(f"{k} x{v}" for k, v in kernels[who].items())}
        if cuda:
            row["step peak GiB above weights"] = peak_mem[who]
        rows.append(row)
    ours.zero_grad(set_to_none=True), hf.zero_grad(set_to_none=True)  # the pair may be reused: free the grads
    counts = cfg.num_params()
    metrics = {
        "config": (f"hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers ({cfg.first_k_dense_replace} dense), "
                   f"{cfg.num_attention_heads} heads q/k {cfg.qk_head_dim} v {cfg.v_head_dim}, q_lora "
                   f"{cfg.q_lora_rank}, kv_lora {cfg.kv_lora_rank}, {cfg.n_routed_experts} experts top-"
                   f"{cfg.num_experts_per_tok} + {cfg.n_shared_experts} shared (moe_intermediate "
                   f"{cfg.moe_intermediate_size}), vocab {cfg.vocab_size}"),
        "params_total_m": counts.total / 1e6, "params_activated_m": counts.activated / 1e6,
        "batch": f"{sizes.batch} x {sizes.seq_len} = {tokens} tokens/step", "dtype": str(dtype),
        "timed_steps_each": len(times["ours"]), "training_gflop_per_token": flops_tok / 1e9,
        "hf_experts_implementation": experts, "hf_experts_probe": experts_report,
        "matmul_ceiling_tflops": ceiling / 1e12, "datasheet_peak_tflops": peak and peak / 1e12,
        "datasheet_source": peak_source, "ours_over_hf": rows[0]["tok/s"] / rows[1]["tok/s"],
        "loss_rel_diff_batch0": abs(losses["ours"] - losses["hf"]) / abs(losses["hf"]),
    }
    return {"status": "measured", "metrics": metrics, "tables": {"train step": rows}}
