"""Cost of the QK-Clip max-logit probe: one training step (forward + backward) with tracking on vs off.

Usage: python benchmarks/bench_probe.py --preset tiny --batch-size 16 --seq-len 256 --repeats 7 --threads 1
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import machine_summary, time_call

from openk2 import K2ForCausalLM, ModelConfig
from openk2.model import ForwardStats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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
