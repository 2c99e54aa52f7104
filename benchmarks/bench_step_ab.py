"""A/B of the train-step speed-ups of issue 25 inside one process: each switched off in turn, and all of them.

One bf16 model of the preset steps (zero grads, forward with labels, backward; no optimizer) in rounds; in each
round every variant -- all options on (the tree), all off (the code before them), and each option off alone --
runs one step on the same fresh batch (so routing changes from round to round, as in training), in an order
reversed every other round. An option is switched off by restoring the predicate that chose the old path
(`OPTIONS`), so "off" runs exactly the previous code. Time is process CPU time per step (with 1 thread robust to
other processes' load); the table gives medians over `--rounds` rounds after `--warmup` rounds.

Before timing, an fp32 copy checks that all-on (forced on in fp32: both options are bf16-only) and all-off give
the same loss and gradients (rtol 1e-5).

Usage: python benchmarks/bench_step_ab.py --preset tiny --rounds 9 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternating_cpu_times, machine_summary  # noqa: E402

import openk2.model.attention_core as attention_core  # noqa: E402
import openk2.model.moe as moe  # noqa: E402
from openk2 import K2ForCausalLM, ModelConfig  # noqa: E402
from openk2.model.short_attention import SHORT_MAX_KEYS  # noqa: E402


def _short_in_any_dtype(q, k, attn_mask) -> bool:
    """takes_short_path without its bf16 condition (for the fp32 check)."""
    return q.device.type == "cpu" and k.shape[2] <= SHORT_MAX_KEYS and (attn_mask is not None
                                                                        or q.shape[2] == k.shape[2])


# option -> (module, predicate name, the predicate that restores the previous path, one that takes the new path
# in fp32 too: both options are bf16-only, so the fp32 check forces them on)
OPTIONS = {
    "aligned_expert_rows": (moe, "aligns_rows", lambda *a: False, lambda *a: True),
    "short_attention": (attention_core, "takes_short_path", lambda *a: False, _short_in_any_dtype),
}


@contextlib.contextmanager
def switched_off(names: list[str], forced_on: tuple[str, ...] = ()):
    """The named options off (their old paths restored) inside the block; those in `forced_on` on in any dtype."""
    saved = [(OPTIONS[n][0], OPTIONS[n][1], getattr(OPTIONS[n][0], OPTIONS[n][1])) for n in OPTIONS]
    try:
        for n in forced_on:
            module, attr, _, on = OPTIONS[n]
            setattr(module, attr, on)
        for n in names:
            module, attr, old, _ = OPTIONS[n]
            setattr(module, attr, old)
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.item()


def switched_step(model: torch.nn.Module, ids: torch.Tensor, off: list[str]) -> float:
    """`step` with the named options off (the switch is a few setattrs: microseconds of a step)."""
    with switched_off(off):
        return step(model, ids)


def check_fp32(model: torch.nn.Module, ids: torch.Tensor, off: list[str]) -> None:
    """All options on (forced, they are bf16-only) vs all off in fp32: the same loss and gradients (rtol 1e-5)."""
    results = []
    for names in ([], off):
        with switched_off(names, forced_on=tuple(OPTIONS)):
            loss = step(model, ids)
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_on, grads_on), (loss_off, grads_off) = results
    worst = max(((grads_on[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in grads_off.items())
    print(f"fp32 check: loss on {loss_on:.6f} off {loss_off:.6f}; largest gradient difference relative to the "
          f"tensor's max {worst:.1e}")
    assert abs(loss_on - loss_off) <= 1e-5 * abs(loss_off) and worst <= 1e-5, "options change the fp32 result"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-leave-one-out", action="store_true", help="only all-on and all-off")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_summary()}")
    cfg = ModelConfig.preset(args.preset)
    torch.manual_seed(args.seed)
    model32 = K2ForCausalLM(cfg).train()
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen)
               for _ in range(args.warmup + args.rounds)]
    names = list(OPTIONS)
    check_fp32(model32, batches[0], names)
    model = copy.deepcopy(model32).to(torch.bfloat16)
    del model32
    variants = {"all on": [], "all off": names}
    if not args.no_leave_one_out and len(names) > 1:
        variants.update({f"off: {n}": [n] for n in names})
    times = alternating_cpu_times(list(variants), lambda v, i: lambda: switched_step(model, batches[i], variants[v]),
                                  args.rounds, warmup=args.warmup)
    off = statistics.median(times["all off"])
    print(f"\n{args.preset}, bf16, batch {args.batch_size} x {args.seq_len}, {args.threads} thread(s): process CPU "
          f"s per step, median of {args.rounds} rounds (after {args.warmup} warm-up)")
    for v, t in times.items():
        print(f"  {v:<28} {statistics.median(t):.3f} s  (range {min(t):.3f}-{max(t):.3f})  "
              f"all-off / this {off / statistics.median(t):.2f}x")
    per_round = [a / b for a, b in zip(times["all off"], times["all on"], strict=True)]
    print(f"  median per-round ratio all off / all on: {statistics.median(per_round):.2f}x")
    print(f"machine after: {machine_summary()}")


if __name__ == "__main__":
    main()
