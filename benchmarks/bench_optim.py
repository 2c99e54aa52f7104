"""Time one optimizer step of openk2's Muon against torch.optim.Muon on a K2 preset's matrix parameters."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from openk2.optim.muon import Muon
from openk2.optim.newton_schulz import NS_KERNELS
from openk2.optim.ns_kernel import gemm_kind, measure_ns_kernels, ns_kernel_timings, select_ns_kernel
from openk2.optim.param_groups import param_groups

# Architecture numbers of the presets, used only when the model package cannot be imported yet.
FALLBACK_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden=256, layers=4, dense_layers=1, intermediate=768, heads=4, q_lora=128, kv_lora=64,
        nope=32, rope=16, v=32, experts=16, moe_intermediate=128, shared=1,
    ),
    "small": dict(
        hidden=512, layers=8, dense_layers=1, intermediate=1536, heads=8, q_lora=256, kv_lora=128,
        nope=64, rope=32, v=64, experts=32, moe_intermediate=256, shared=1,
    ),
}  # fmt: skip


def fallback_shapes(preset: str) -> list[tuple[str, tuple[int, ...]]]:
    """Muon parameter shapes of a preset, following HF DeepseekV3 naming and layout."""
    c = FALLBACK_PRESETS[preset]
    H, heads = c["hidden"], c["heads"]
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for i in range(c["layers"]):
        pre = f"model.layers.{i}"
        shapes += [
            (f"{pre}.self_attn.q_a_proj.weight", (c["q_lora"], H)),
            (f"{pre}.self_attn.q_b_proj.weight", (heads * (c["nope"] + c["rope"]), c["q_lora"])),
            (f"{pre}.self_attn.kv_a_proj_with_mqa.weight", (c["kv_lora"] + c["rope"], H)),
            (f"{pre}.self_attn.kv_b_proj.weight", (heads * (c["nope"] + c["v"]), c["kv_lora"])),
            (f"{pre}.self_attn.o_proj.weight", (H, heads * c["v"])),
        ]
        if i < c["dense_layers"]:
            inter = c["intermediate"]
            shapes += [
                (f"{pre}.mlp.gate_proj.weight", (inter, H)),
                (f"{pre}.mlp.up_proj.weight", (inter, H)),
                (f"{pre}.mlp.down_proj.weight", (H, inter)),
            ]
            continue
        E, inter = c["experts"], c["moe_intermediate"]
        shared = inter * c["shared"]
        shapes += [
            (f"{pre}.mlp.gate.weight", (E, H)),
            (f"{pre}.mlp.experts.gate_proj", (E, inter, H)),
            (f"{pre}.mlp.experts.up_proj", (E, inter, H)),
            (f"{pre}.mlp.experts.down_proj", (E, H, inter)),
            (f"{pre}.mlp.shared_experts.gate_proj.weight", (shared, H)),
            (f"{pre}.mlp.shared_experts.up_proj.weight", (shared, H)),
            (f"{pre}.mlp.shared_experts.down_proj.weight", (H, shared)),
        ]
    return shapes


def model_shapes(preset: str) -> list[tuple[str, tuple[int, ...]]] | None:
    """Muon parameter shapes taken from the real model and param_groups, or None if unavailable."""
    try:
        from openk2.config import ModelConfig
        from openk2.model import K2ForCausalLM
    except ImportError:
        return None
    try:
        config = ModelConfig.preset(preset)
    except (KeyError, ValueError):
        return None
    # Only shapes are needed, so build on the meta device to skip allocation and init.
    with torch.device("meta"):
        model = K2ForCausalLM(config)
    muon_group = next(g for g in param_groups(model, lr=1.0, weight_decay=0.0) if g["use_muon"])
    return [(n, tuple(p.shape)) for n, p in zip(muon_group["param_names"], muon_group["params"], strict=True)]


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall time covers the whole step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    steps: dict[str, Callable[[], Any]], warmup: int, repeats: int, device: torch.device
) -> dict[str, float]:
    """Median wall time in ms of each step function, interleaved so load spikes hit all of them alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def leaf(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.nn.Parameter:
    """A random fp32 parameter with a random gradient."""
    p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(device))
    p.grad = torch.randn(shape, generator=gen).to(device)
    return p


def bench_preset(
    preset: str, warmup: int, repeats: int, device: torch.device, *, with_torch: bool, kernels: list[str]
) -> dict[str, Any]:
    """Benchmark torch's Muon and ours (the auto-selected kernel, plus each kernel in `kernels`) on one preset."""
    shapes = model_shapes(preset)
    source = "model"
    if shapes is None:
        shapes, source = fallback_shapes(preset), "fallback shapes"
    gen = torch.Generator().manual_seed(0)
    kw = dict(lr=2e-4, weight_decay=0.1, momentum=0.95, nesterov=True)
    ours_params = [leaf(s, gen, device) for _, s in shapes]
    steps = {"ours": Muon(ours_params, **kw).step}
    if with_torch:
        # torch.optim.Muon rejects 3-D tensors, so it gets every expert as its own matrix.
        matrices = [s[-2:] for _, s in shapes for _ in range(s[0] if len(s) == 3 else 1)]
        torch_params = [leaf(s, gen, device) for s in matrices]
        steps["torch"] = torch.optim.Muon(torch_params, adjust_lr_fn="match_rms_adamw", **kw).step
    for kernel in kernels:
        pinned = [leaf(s, gen, device) for _, s in shapes]
        steps[kernel] = Muon(pinned, ns_kernel=kernel, **kw).step
    ms = time_steps(steps, warmup, repeats, device)
    return {
        "preset": preset,
        "source": source,
        "tensors": len(shapes),
        "matrices": sum(s[0] if len(s) == 3 else 1 for _, s in shapes),
        "params_m": sum(p.numel() for p in ours_params) / 1e6,
        **{f"{name}_ms": v for name, v in ms.items()},
    }


def _cell(ms: float | None, width: int) -> str:
    """A right-aligned ms value, or '-' when not measured."""
    return f"{ms:>{width}.1f}" if ms is not None else f"{'-':>{width}}"


def _ratio(num: float | None, den: float | None, width: int) -> str:
    """A right-aligned num/den ratio, or '-' when either is missing."""
    return f"{num / den:>{width - 1}.1f}x" if num is not None and den is not None else f"{'-':>{width}}"


def main() -> None:
    """Run the benchmark and print a table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=sorted(FALLBACK_PRESETS))
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per optimizer (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per optimizer before timing")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--skip-torch", action="store_true", help="time only ours (torch's CPU step takes minutes on small)"
    )
    parser.add_argument(
        "--kernels", nargs="*", default=[], choices=sorted(NS_KERNELS),
        help="also time ours pinned to these Newton-Schulz kernels (default: only the auto-selected one)",
    )
    parser.add_argument("--native", action="store_true", help="the same as --kernels native (older spelling)")
    args = parser.parse_args()
    if args.native and "native" not in args.kernels:
        args.kernels.append("native")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError("--repeats must be >= 1 and --warmup >= 0")
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    print(
        f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} CPU threads, fp32 params, "
        f"median of {args.repeats} interleaved steps after {args.warmup} warm-up"
    )
    chosen = select_ns_kernel(device, torch.bfloat16)
    probe = ns_kernel_timings(device, torch.bfloat16) or {}
    print(f"bf16 GEMM kind: {gemm_kind(device, torch.bfloat16)}; start-up probe (ms): "
          + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in probe.items()) + f"; auto-selected: {chosen}")
    skipped = [k for k in NS_KERNELS if k not in probe]
    if skipped:  # the capability rule left these out of the probe; time them once, for the record
        extra = measure_ns_kernels(device, torch.bfloat16, kernels=skipped)
        print("not probed (capability rule), timed for reference (ms): "
              + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in extra.items()))
    header = (
        f"{'preset':<7} {'shapes from':<16} {'tensors':>7} {'matrices':>8} {'params':>8} "
        f"{'torch ms':>10} {'ours ms':>9} {'torch/ours':>10}"
    )
    for kernel in args.kernels:
        header += f" {kernel + ' ms':>11} {'torch/' + kernel:>14}"
    print(header)
    print("-" * len(header))
    for preset in args.presets:
        with_torch = not args.skip_torch
        r = bench_preset(preset, args.warmup, args.repeats, device, with_torch=with_torch, kernels=args.kernels)
        torch_ms, ours_ms = r.get("torch_ms"), r["ours_ms"]
        line = (
            f"{r['preset']:<7} {r['source']:<16} {r['tensors']:>7} {r['matrices']:>8} {r['params_m']:>7.2f}M "
            f"{_cell(torch_ms, 10)} {_cell(ours_ms, 9)} {_ratio(torch_ms, ours_ms, 10)}"
        )
        for kernel in args.kernels:
            line += f" {_cell(r[kernel + '_ms'], 11)} {_ratio(torch_ms, r[kernel + '_ms'], 14)}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
