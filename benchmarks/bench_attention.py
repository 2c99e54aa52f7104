"""Attention core at MLA's head dims (q/k 192, v 128 as in K2): SDPA as called before (unequal dims: the math
kernel, [B, H, T, T] scores) against `attention_core.attend` (v padded: the fused kernel). Median time and peak
memory (RSS growth above the inputs, each case in a fresh process) per length, forward and forward+backward;
optionally with the max-logit probe (`--probe`: `attend_with_max`, fused on CPU), and one forward of the tiny
preset cut to 1 layer and 8 heads (`--model`).

Usage: python benchmarks/bench_attention.py --lengths 1024 4096 16384 --heads 8 --repeats 3 --threads 1
       python benchmarks/bench_attention.py --model --lengths 8192
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch
import torch.nn.functional as F
from common import machine_summary, median_time

from openk2.model.attention_core import attend, attend_with_max

QK_DIM, V_DIM = 192, 128  # K2: qk_nope 128 + qk_rope 64, v 128


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _core_case(kernel: str, t: int, heads: int, backward: bool, probe: bool, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, t, QK_DIM, generator=g, requires_grad=backward)
    k = torch.randn(1, heads, t, QK_DIM, generator=g, requires_grad=backward)
    v = torch.randn(1, heads, t, V_DIM, generator=g, requires_grad=backward)
    scale = QK_DIM ** -0.5

    def run() -> None:
        if kernel == "math":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        elif probe:
            out = attend_with_max(q, k, v, scale)[0]
        else:
            out = attend(q, k, v, scale)
        if backward:
            out.sum().backward()
            q.grad = k.grad = v.grad = None

    base = _rss_mb()
    seconds, _ = median_time(run, repeats)
    return {"seconds": seconds, "peak_mb": _peak_mb() - base}


def _model_case(t: int, probe: bool, repeats: int) -> dict:
    from openk2 import K2ForCausalLM, ModelConfig
    from openk2.model import ForwardStats

    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=1, num_attention_heads=8, first_k_dense_replace=1,
                                             max_position_embeddings=max(t, 4096))
    torch.manual_seed(0)
    model = K2ForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, t))

    def run() -> None:
        with torch.no_grad():
            model(ids, stats=ForwardStats(cfg, track_max_logits=probe))

    base = _rss_mb()
    seconds, _ = median_time(run, repeats)
    return {"seconds": seconds, "peak_mb": _peak_mb() - base,
            "dims": f"q/k {cfg.qk_head_dim}, v {cfg.v_head_dim}, heads {cfg.num_attention_heads}; "
                    f"process peak {_peak_mb():,.0f} MB"}


def _child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    case = json.loads(args.child)
    if case["what"] == "model":
        result = _model_case(case["t"], case["probe"], args.repeats)
    else:
        result = _core_case(case["kernel"], case["t"], args.heads, case["backward"], case["probe"], args.repeats)
    print(json.dumps({**case, **result}))


def _in_fresh_process(case: dict, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(case), "--heads", str(args.heads),
           "--repeats", str(args.repeats), "--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {**case, "error": done.stderr.strip().splitlines()[-1] if done.stderr else f"rc {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--math-max", type=int, default=4096, help="longest length run on the math kernel")
    parser.add_argument("--probe", action="store_true", help="also time fused attention with the probe")
    parser.add_argument("--model", action="store_true", help="tiny preset, 1 layer, 8 heads, forward only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)
    print(machine_summary())
    cases = []
    for t in args.lengths:
        if args.model:
            cases += [{"what": "model", "t": t, "probe": p} for p in (False, True)]
            continue
        for backward in (False, True):
            kernels = ["math"] * (t <= args.math_max) + ["fused"]
            cases += [{"what": "core", "kernel": kn, "t": t, "backward": backward, "probe": False} for kn in kernels]
            if args.probe:
                cases.append({"what": "core", "kernel": "fused", "t": t, "backward": backward, "probe": True})
    for case in cases:
        r = _in_fresh_process(case, args)
        label = (f"model T={r['t']} probe={'on' if r['probe'] else 'off'}" if case["what"] == "model" else
                 f"T={r['t']:>6} {'fwd+bwd' if r['backward'] else 'fwd    '} {r['kernel']:>5}"
                 f"{' +probe' if r['probe'] else ''}")
        if "error" in r:
            print(f"{label}: failed: {r['error']}", flush=True)
        else:
            print(f"{label}: {r['seconds'] * 1e3:,.0f} ms, peak +{r['peak_mb']:,.0f} MB"
                  f"{'  (' + r['dims'] + ')' if 'dims' in r else ''}", flush=True)


if __name__ == "__main__":
    main()
