"""Activation memory and step time of each `[memory]` option, and the loss difference FP8 activation storage causes.

Part 1 (memory/time): one model from a preset, one fixed random batch, and one training step (zero grads,
forward with labels, backward; no optimizer) per option set, with the options applied by
`openk2.train.memory.apply_memory_options` and removed after. Per option set, after `--warmup` untimed steps
(the first checkpointed call imports and allocates lazily), `--repeats` steps are timed and measured, going
round-robin over the option sets so that drift in machine load hits all of them alike:

* held: activation bytes alive right after the forward (what backward will read), i.e. allocated bytes after
  the forward minus before. CUDA: `torch.cuda.memory_allocated`. CPU: glibc's heap in use (`mallinfo2`
  uordblks + hblkhd; torch's CPU allocator is plain malloc, so this counts tensors to within malloc's
  rounding). For CPU offload the host copies the offloader holds are subtracted: on a GPU they would sit in
  host memory.
* peak (CUDA only): `torch.cuda.max_memory_allocated` during the whole step minus the allocation before it,
  which adds the backward's transients (recomputed layers, gradients).
* step time: median of the timed steps. All options are exact except FP8, so the script also asserts that
  recompute and offload give the same loss as the plain step.

Part 2 (`--loss-steps N`): two short pre-training runs of `--loss-config` (MuonClip, WSD, the shipped data)
with identical seeds, one plain and one with `memory.fp8_activations = true`, and the per-step training losses
compared (each run's tokenizer is the same file). Selective recompute is on in both runs so that the FP8 run
stores exactly the report's set (block inputs and SwiGLU inputs) and nothing else differs.

Usage:
  python benchmarks/bench_memory.py --preset small --batch-size 4 --seq-len 256 --repeats 3
  python benchmarks/bench_memory.py --skip-memory --loss-steps 60
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_summary, time_call  # noqa: E402

from openk2 import K2ForCausalLM, ModelConfig  # noqa: E402
from openk2.train.config import load_run_config  # noqa: E402
from openk2.train.memory import MemorySection, allocated_bytes, apply_memory_options  # noqa: E402
from openk2.train.metrics import read_metrics  # noqa: E402
from openk2.train.trainer import Trainer  # noqa: E402

OPTION_SETS = {
    "none": MemorySection(),
    "selective recompute": MemorySection(recompute="selective"),
    "full recompute": MemorySection(recompute="full"),
    "fp8 activations": MemorySection(fp8_activations=True),
    "cpu offload": MemorySection(cpu_offload=True),
    "selective + fp8": MemorySection(recompute="selective", fp8_activations=True),
    "selective + fp8 + offload": MemorySection(recompute="selective", fp8_activations=True, cpu_offload=True),
}


def measured_step(model: K2ForCausalLM, ids: torch.Tensor, cfg: MemorySection) -> dict:
    """One training step under `cfg`: loss, held activation bytes, CUDA peak, seconds."""
    device = ids.device
    handle = apply_memory_options(model, cfg)
    try:
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        before = allocated_bytes(device)
        record: dict = {}

        def step() -> None:
            out = model(ids, labels=ids)
            held = allocated_bytes(device)
            if held is not None and before is not None:
                offloaded = handle.offloader.stats.held_bytes if handle.offloader else 0
                record["held"] = held - before - offloaded
                record["offloaded"] = offloaded
            out.loss.backward()
            record["loss"] = out.loss.item()

        record["seconds"] = time_call(step)
        if device.type == "cuda":
            record["peak"] = torch.cuda.max_memory_allocated(device) - before
        return record
    finally:
        handle.remove()


def memory_table(args: argparse.Namespace, device: torch.device) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.preset(args.preset)
    model = K2ForCausalLM(cfg).to(device).train()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model.to(dtype)
    ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len),
                        generator=torch.Generator().manual_seed(1)).to(device)
    print(f"# {args.preset} preset, batch {args.batch_size} x {args.seq_len}, {args.dtype} weights, {device}; "
          f"{machine_summary()}", flush=True)
    # Warm-up, then the timed steps round-robin over the option sets, so drift in machine load hits all alike.
    for options in OPTION_SETS.values():
        for _ in range(args.warmup):
            measured_step(model, ids, options)
    steps: dict[str, list[dict]] = {name: [] for name in OPTION_SETS}
    for _ in range(args.repeats):
        for name, options in OPTION_SETS.items():
            steps[name].append(measured_step(model, ids, options))
    rows, reference = [], None
    for name, options in OPTION_SETS.items():
        done = steps[name]
        held = statistics.median(s["held"] for s in done) if "held" in done[0] else float("nan")
        peak = statistics.median(s["peak"] for s in done) if "peak" in done[0] else float("nan")
        seconds = [s["seconds"] for s in done]
        loss = done[0]["loss"]
        if reference is None:
            reference = (held, statistics.median(seconds), loss)
        elif not options.fp8_activations:
            assert loss == reference[2], f"{name}: loss {loss} differs from the plain step's {reference[2]}"
        rows.append((name, held, peak, statistics.median(seconds), min(seconds), max(seconds),
                     done[0].get("offloaded", 0), loss))
    print("\n| options | activations held after forward | vs none | peak during step | step time (median) | "
          "vs none | step range | offloaded to host | loss |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name, held, peak, med, lo, hi, offloaded, loss in rows:
        peak_text = f"{peak / 2**20:.1f} MiB" if peak == peak else "n/a (CPU)"
        print(f"| {name} | {held / 2**20:.1f} MiB | {held / reference[0]:.2f}x | {peak_text} | {med:.2f} s | "
              f"{med / reference[1]:.2f}x | {lo:.2f}-{hi:.2f} s | {offloaded / 2**20:.1f} MiB | {loss:.6f} |")


def loss_comparison(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        tokenizer = args.tokenizer
        for name, fp8 in (("plain", False), ("fp8", True)):
            overrides = [f"train.steps={args.loss_steps}", "train.log_every=1", f"train.eval_every={args.loss_steps}",
                         f"train.checkpoint_every={args.loss_steps}", "memory.recompute=\"selective\"",
                         f"memory.fp8_activations={'true' if fp8 else 'false'}", f"train.batch_size={args.batch_size}",
                         "schedule.warmup_steps=5", f"tokenizer.train_chars={args.tokenizer_chars}"]
            if tokenizer:
                overrides.append(f"tokenizer.path=\"{tokenizer}\"")
            cfg = load_run_config(args.loss_config, overrides)
            out = Path(tmp) / name
            start = time.perf_counter()
            Trainer(cfg, out_dir=out).run()
            print(f"  {name} run: {time.perf_counter() - start:.0f} s", flush=True)
            runs[name] = [r["loss"] for r in read_metrics(out) if "loss" in r and not r.get("skipped")]
            tokenizer = tokenizer or str(out / "tokenizer")
    plain, fp8 = runs["plain"], runs["fp8"]
    diffs = [b - a for a, b in zip(plain, fp8, strict=True)]
    tail = max(1, len(plain) // 5)
    print(f"\n# FP8 activation storage over {len(plain)} steps of {args.loss_config} (selective recompute in both)")
    print("| steps | plain loss | fp8 loss | fp8 - plain |")
    print("|---|--:|--:|--:|")
    for label, sl in (("first", slice(0, 1)), (f"last {tail} (mean)", slice(-tail, None))):
        p, f = statistics.mean(plain[sl]), statistics.mean(fp8[sl])
        print(f"| {label} | {p:.4f} | {f:.4f} | {f - p:+.4f} |")
    print(f"max |fp8 - plain| over all steps: {max(abs(d) for d in diffs):.4f}; "
          f"mean fp8 - plain: {statistics.mean(diffs):+.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--skip-memory", action="store_true", help="only run the FP8 loss comparison")
    parser.add_argument("--loss-steps", type=int, default=0, help="steps of each FP8 loss-comparison run (0: skip)")
    parser.add_argument("--loss-config", default="configs/tiny.toml")
    parser.add_argument("--tokenizer", default=None, help="a saved tokenizer for the loss runs (default: train one)")
    parser.add_argument("--tokenizer-chars", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.skip_memory:
        memory_table(args, torch.device(args.device))
    if args.loss_steps:
        loss_comparison(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
