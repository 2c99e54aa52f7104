"""Cost of the QK-Clip max-logit probe: one training step (forward + backward) with tracking on vs off; with
`--core`, the attention core alone at K2's head dims (q/k 192, v 128) per length: the probe's time overhead
(interleaved medians, forward and forward+backward) and its peak memory (RSS growth, in a fresh process).

Usage: python benchmarks/bench_probe.py --preset tiny --batch-size 16 --seq-len 256 --repeats 7 --threads 1
       python benchmarks/bench_probe.py --core --lengths 1024 4096 16384 --heads 8 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys

import torch
from common import machine_summary, time_call

from openk2 import K2ForCausalLM, ModelConfig
from openk2.model import ForwardStats
from openk2.model.attention_core import attend, attend_with_max, head_max_logits

QK_DIM, V_DIM = 192, 128


def _interleaved(fns: dict[str, object], repeats: int) -> dict[str, float]:
    """Median seconds of each fn, timed in alternating order so load drift hits all alike."""
    names = list(fns)
    for name in names:
        fns[name]()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in (names if i % 2 == 0 else names[::-1]):
            times[name].append(time_call(fns[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _core_child(t: int, heads: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, heads, t, QK_DIM, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(1, heads, t, V_DIM, generator=g, requires_grad=True)
    scale = QK_DIM ** -0.5
    with open("/proc/self/statm") as fh:
        base = int(fh.read().split()[1]) * resource.getpagesize() / 2**20
    head_max_logits(q, k, scale)  # first, so the process peak is the separate probe's own
    probe_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    with torch.no_grad():
        attend(q, k, v, scale)
    attend_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    with torch.no_grad():
        attend_with_max(q, k, v, scale)
    fused_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base

    def core(probe: str):
        if probe == "fused":
            return attend_with_max(q, k, v, scale)[0]
        if probe == "separate":
            head_max_logits(q, k, scale)
        return attend(q, k, v, scale)

    def fwd(probe: str) -> None:
        with torch.no_grad():
            core(probe)

    def step(probe: str) -> None:
        core(probe).sum().backward()
        q.grad = k.grad = v.grad = None

    modes = ("off", "fused", "separate")
    fwd_t = _interleaved({m: lambda m=m: fwd(m) for m in modes}, repeats)
    step_t = _interleaved({m: lambda m=m: step(m) for m in modes}, repeats)
    return {"t": t, "probe_mb": probe_mb, "attend_mb": attend_mb, "fused_mb": fused_mb, "fwd": fwd_t,
            "step": step_t}


def core_main(args: argparse.Namespace) -> None:
    """Per length, in a fresh process each: the probe's peak memory and its time overhead on the core."""
    print(machine_summary())
    for t in args.lengths:
        cmd = [sys.executable, __file__, "--core-child", str(t), "--heads", str(args.heads),
               "--repeats", str(args.repeats), "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        f, s = r["fwd"], r["step"]
        # peaks are running maxima of one process: separate probe, then + attention, then + fused pass
        print(f"T={t:>6} H={args.heads}: peak forward memory +{r['probe_mb']:,.0f} MB after the separate probe, "
              f"+{r['attend_mb']:,.0f} MB after attention, +{r['fused_mb']:,.0f} MB after the fused pass",
              flush=True)
        for name, times in (("forward", f), ("forward+backward", s)):
            print(f"    {name}: no probe {times['off'] * 1e3:,.0f} ms, fused {times['fused'] * 1e3:,.0f} ms "
                  f"(x{times['fused'] / times['off']:.2f}), separate {times['separate'] * 1e3:,.0f} ms "
                  f"(x{times['separate'] / times['off']:.2f})", flush=True)

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--core", action="store_true", help="the attention core at K2's head dims, per length")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--core-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.core_child:
        return print(json.dumps(_core_child(args.core_child, args.heads, args.repeats)))
    if args.core:
        return core_main(args)
    torch.manual_seed(0)
    cfg = ModelConfig.preset(args.preset)
    model = K2ForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len))

    def step(track: bool) -> None:
        stats = ForwardStats(cfg, track_max_logits=track)
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids, stats=stats).loss.backward()
        stats.max_logits()

    times: dict[bool, list[float]] = {True: [], False: []}
    step(True), step(False)  # warm-up
    for i in range(args.repeats):  # interleaved so load drift hits both alike
        for track in ((True, False) if i % 2 == 0 else (False, True)):
            times[track].append(time_call(lambda t=track: step(t)))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(machine_summary())
    print(f"{args.preset} B={args.batch_size} T={args.seq_len}: step {off * 1e3:.0f} ms without the probe, "
          f"{on * 1e3:.0f} ms with it: +{(on / off - 1) * 100:.1f}%")


if __name__ == "__main__":
    main()
