"""Batched greedy decoding on `hf:smollm2` with transformers' `DynamicCache` (a `torch.cat` of the whole cache
per step) against `openk2.llm.hf_cache.growing_cache` (in-place appends): a `--context`-token prompt prefilled
(untimed), then `--new` greedy decode steps; CPU seconds of this thread (`time.thread_time`) per decode step,
median over `--repeats`, per batch size; the decoded tokens must match.

Usage: OMP_NUM_THREADS=1 python benchmarks/bench_hf_decode_cache.py --batches 8 32 --context 300 --new 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from common import machine_summary, quiet_transformers
from transformers import DynamicCache

from openk2.llm.hf_backend import HFChatModel
from openk2.llm.hf_cache import growing_cache


def _decode(model, ids: torch.Tensor, cache, steps: int) -> tuple[float, torch.Tensor]:
    """Prefill `ids` into `cache` (untimed), then `steps` greedy decode steps; (CPU seconds of the steps, tokens)."""
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        got = [tok]
        t0 = time.thread_time()
        for _ in range(steps):
            out = model(input_ids=tok, cache=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            got.append(tok)
        return time.thread_time() - t0, torch.cat(got, dim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    quiet_transformers()
    model = HFChatModel("smollm2").model
    layers = model.config.num_hidden_layers
    rows = []
    for batch in args.batches:
        ids = torch.randint(100, 40000, (batch, args.context), generator=torch.Generator().manual_seed(batch))
        times: dict[str, list[float]] = {"dynamic": [], "growing": []}
        outs = {}
        for _ in range(args.repeats):
            for name in times:  # interleaved
                cache = DynamicCache() if name == "dynamic" else growing_cache(reserve=args.new + 1, num_layers=layers)
                seconds, outs[name] = _decode(model, ids, cache, args.new)
                times[name].append(seconds / args.new)
        rows.append({"batch": batch, **{f"{n}_s_per_step": round(statistics.median(t), 4) for n, t in times.items()},
                     "same_tokens": bool(torch.equal(outs["dynamic"], outs["growing"]))})
    print(json.dumps({"machine": machine_summary(), "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
