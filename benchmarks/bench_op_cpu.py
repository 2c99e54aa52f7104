"""Process CPU time of one bf16 training step by ATen op, ours and transformers' DeepseekV3 on the same weights.

A TorchDispatchMode times every ATen call the step makes (forward and backward alike, below autograd) with
`time.process_time()` around the call only, so the mode's own Python overhead is not charged to the ops and the
figures hold under other processes' load (1 thread). It answers what the profiler's wall times cannot on a
loaded machine: how much of each model's step the matmul kernels both share take (`mm`, `_grouped_mm`,
`bmm`), and so the step time a given speed-up of everything else could reach. The step of least in-op time of
`--steps` is reported, after two warm-up steps; the two models alternate step by step.

Usage: python benchmarks/bench_op_cpu.py --preset tiny --steps 4 --top 16
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternating_cpu_times, hf_copy, machine_summary  # noqa: E402

from openk2 import K2ForCausalLM, ModelConfig  # noqa: E402

WARMUP = 2  # untimed steps per model first (oneDNN builds its kernels, the allocator settles)
MATMULS = ("mm", "_grouped_mm", "bmm", "addmm", "baddbmm")


class OpCpuTimes(TorchDispatchMode):
    """CPU seconds and calls per ATen op (overload dropped) of everything run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.process_time()
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        self.seconds[name] += time.process_time() - start
        self.calls[name] += 1
        return out


def step(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> None:
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids, **kwargs).loss.backward()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_summary()}")
    cfg = ModelConfig.preset(args.preset)
    torch.manual_seed(0)
    ours = K2ForCausalLM(cfg).train()
    hf = hf_copy(ours, attn_implementation="sdpa", experts_implementation="grouped_mm").train().to(torch.bfloat16)
    ours = ours.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen)
               for _ in range(WARMUP + args.steps)]
    runs = {"ours": (ours, {}), "HF": (hf, {"use_cache": False})}
    modes: dict[str, list[OpCpuTimes]] = {who: [] for who in runs}

    def prepare(who: str, i: int):
        model, kwargs = runs[who]
        if i < WARMUP:
            return lambda: step(model, batches[i], **kwargs)
        mode = OpCpuTimes()
        modes[who].append(mode)

        def timed() -> None:
            with mode:
                step(model, batches[i], **kwargs)
        return timed

    totals = alternating_cpu_times(list(runs), prepare, args.steps, warmup=WARMUP)
    for who in runs:
        best = min(range(args.steps), key=lambda j: sum(modes[who][j].seconds.values()))
        mode, total = modes[who][best], totals[who][best]
        in_ops = sum(mode.seconds.values())
        matmul = sum(t for k, t in mode.seconds.items() if k in MATMULS)
        print(f"\n{who}: step {total:.3f} s CPU under the mode, {in_ops:.3f} s inside ATen ops; matmul kernels "
              f"({', '.join(MATMULS)}) {matmul:.3f} s = {matmul / in_ops:.0%} of the in-op time")
        for name, t in sorted(mode.seconds.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {name:<32} {t * 1e3:7.1f} ms  {t / in_ops:5.1%}  calls {mode.calls[name]}")
    print(f"machine after: {machine_summary()}")


if __name__ == "__main__":
    main()
