"""Training-step throughput of openk2's K2ForCausalLM against transformers' DeepseekV3ForCausalLM, same weights.

One process builds our model from a preset, writes it with `save_pretrained`, loads the checkpoint into HF's
DeepseekV3ForCausalLM (attn_implementation="sdpa", the fastest `experts_implementation` found on this machine)
and times one training step -- zero grads, forward with labels, backward of the mean next-token loss; no
optimizer -- on the same random batches for both models. The two models alternate step by step (ours first on
even repeats, HF first on odd ones) so slow drift in machine load hits both alike; the reported figure is the
median over `--repeats` timed steps after `--warmup` untimed ones (fewer, but at least 2, when the timed
steps of a dtype would exceed `--max-seconds`: a bf16 step takes ~20 s on a CPU without native bf16). Before
timing, the script asserts that both models give the same fp32 loss on the first batch (relative difference
<= 1e-4).

Reduced precision: for bf16 both models are deep-copied from the fp32 ones and their parameters and buffers
cast to bf16 (`model.to(torch.bfloat16)`); no autocast. Both models still compute RMSNorm, router scores and
the cross-entropy in fp32 internally, as their code does.

HF experts implementation: with `--hf-experts auto` every implementation registered in
transformers.integrations.moe.ExpertsInterface plus "eager" is timed on one sequence in fp32 (a warm-up, then
the best of two round-robin timed steps each; the CUDA-kernel ones -- deepgemm, sonicmoe -- are skipped without
a GPU, and any that fails is reported and skipped) and the fastest is used for every dtype.

FLOPs per token of one training step (forward + backward = 3x the forward's 2 FLOPs per multiply-add):

    6 * P_matmul + 3 * 2 * n_layers * n_heads * (qk_head_dim + v_head_dim) * seq_len / 2

    P_matmul = activated params - embedding - norms - router bias (e_score_correction_bias)

i.e. every weight matrix one token touches (MLA projections, dense MLP, shared expert, its k routed experts,
router, lm_head; an embedding lookup is not a matmul, unless it is tied to lm_head, then it is kept), plus the
attention scores QK^T (qk_head_dim) and the weighted sum over values (v_head_dim) against seq_len/2 keys on
average under the causal mask. Elementwise work (norms, rope, softmax, SiLU, routing, loss) is not counted.

MFU = achieved FLOP/s of our step / matmul ceiling, where the ceiling is the median FLOP/s of five
n x n @ (n x n)^T matmuls (the nn.Linear weight layout) in the same dtype and thread count, measured in this run.

Usage: python benchmarks/bench_model.py --preset tiny --batch-size 8 --seq-len 256 --repeats 5 --dtypes fp32,bf16
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step_ab import OPTIONS as STEP_AB_OPTIONS  # noqa: E402
from common import DTYPES, hf_copy, machine_summary, quiet_transformers, time_call  # noqa: E402
from profile_step import profile_step  # noqa: E402

from openk2 import K2ForCausalLM, ModelConfig  # noqa: E402
from openk2.model.compile import allow_a_graph_per_block, compile_blocks, compile_seconds  # noqa: E402
from openk2.train.flops import measure_matmul_peak, training_flops_per_token  # noqa: E402

MIN_REPEATS = 2  # timed steps per model and dtype that --max-seconds never cuts below


def train_step(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.item()


def hf_step_kwargs() -> dict:
    return {"use_cache": False}  # training: no KV cache object per forward


def load_hf(model: torch.nn.Module, experts: str):
    """HF DeepseekV3 with `model`'s weights, SDPA attention and the given experts implementation, in train mode."""
    return hf_copy(model, attn_implementation="sdpa", experts_implementation=experts).train()


# Registered experts implementations that need CUDA kernels (loaded from the Hub); not tried on CPU.
CUDA_ONLY_EXPERTS = ("deepgemm", "sonicmoe")


def experts_candidates() -> tuple[list[str], list[str]]:
    """(implementations to try, registered ones skipped because they need CUDA)."""
    from transformers.integrations.moe import ExpertsInterface

    registered = list(ExpertsInterface._global_mapping)
    skipped = [k for k in registered if k in CUDA_ONLY_EXPERTS and not torch.cuda.is_available()]
    return [k for k in registered if k not in skipped] + ["eager"], skipped


def pick_hf_experts(hf, seq_len: int, vocab: int, rounds: int = 2) -> tuple[str, dict[str, str]]:
    """Time each experts implementation on one fp32 sequence (after a warm-up, `rounds` round-robin passes, best
    of them, so a burst of load from other processes does not decide); returns the fastest and a report."""
    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(123))
    candidates, skipped = experts_candidates()
    report = {k: "skipped (CUDA only)" for k in skipped}
    best_time: dict[str, float] = {}
    for r in range(rounds + 1):
        for impl in candidates:
            if impl in report:
                continue
            try:
                hf.set_experts_implementation(impl)
                seconds = time_call(lambda: train_step(hf, ids, **hf_step_kwargs()))
            except Exception as err:  # noqa: BLE001 -- e.g. a kernel this device lacks
                first_line = (str(err).splitlines() or [""])[0][:60]
                report[impl] = f"unavailable ({type(err).__name__}: {first_line})"
                continue
            if r > 0:  # round 0 is the warm-up
                best_time[impl] = min(seconds, best_time.get(impl, float("inf")))
    if not best_time:
        raise RuntimeError(f"no HF experts implementation ran: {report}")
    report.update({k: f"{seq_len / t:,.0f} tok/s" for k, t in best_time.items()})
    return min(best_time, key=best_time.get), report


# --ab-compiled: bench_step_ab's options, each (module, predicate name, ...): False takes the path before it
COMPILED_AB_OPTIONS = STEP_AB_OPTIONS


class OffUnderCompile:
    """The switch of `--ab-compiled OPTION`: while `off`, compiled blocks take the path before OPTION (its predicate
    answers False under compile); eager steps and the other compiled copies are unchanged.

    The predicate is replaced for the whole process; dynamo guards on the value of `off` it read, so each value
    keeps its own graphs and switching between steps does not recompile (checked: the compile seconds during the
    timed steps are printed)."""

    off = False

    @classmethod
    def install(cls, option: str) -> None:
        module, name = COMPILED_AB_OPTIONS[option][:2]
        rule = getattr(module, name)

        def predicate(*args) -> bool:
            if torch.compiler.is_compiling() and cls.off:
                return False
            return rule(*args)

        setattr(module, name, predicate)

    @classmethod
    def step(cls, model: torch.nn.Module, ids: torch.Tensor) -> float:
        cls.off = True
        try:
            return train_step(model, ids)
        finally:
            cls.off = False


def compiled_steps(ours: torch.nn.Module, hf: torch.nn.Module, ids: torch.Tensor, warmups: dict[str, float],
                   ab_option: str | None = None):
    """Step functions for block-compiled copies of both models (and with `ab_option` a third, ours compiled with
    that option off: `OffUnderCompile`); their first (compiling) step is run here and its wall time stored in
    `warmups` (with the compile seconds torch reports, when it does)."""
    ours_c = copy.deepcopy(ours)
    compile_blocks(ours_c)
    hf_c = copy.deepcopy(hf)
    for layer in hf_c.model.layers:  # the same regional compile, applied to HF's decoder layers
        layer.compile(dynamic=True)
    steps = {"ours_compiled": lambda x, m=ours_c: train_step(m, x),
             "hf_compiled": lambda x, m=hf_c: train_step(m, x, **hf_step_kwargs())}
    if ab_option:
        # Our blocks get one graph per layer position, and compile_blocks makes room for one model's blocks:
        # room for the second copy's graphs too, or its blocks would run eagerly.
        allow_a_graph_per_block(2 * len(ours.model.layers))
        OffUnderCompile.install(ab_option)
        ours_off = copy.deepcopy(ours)
        compile_blocks(ours_off)
        steps["ours_compiled_off"] = lambda x, m=ours_off: OffUnderCompile.step(m, x)
    for who, step in steps.items():
        before, start = compile_seconds(), time.perf_counter()
        step(ids)
        warmups[who] = time.perf_counter() - start
        spent = compile_seconds()
        note = f", of which compiling {spent - before:.0f} s" if spent is not None and before is not None else ""
        print(f"{who}: first step {warmups[who]:.0f} s{note}", flush=True)
    return steps


def print_compiled(name: str, times: dict[str, list[float]], cpu_times: dict[str, list[float]],
                   warmups: dict[str, float], tokens: int, flops_tok: float, ceiling: float,
                   compiled_before: float | None, option: str | None = None) -> None:
    """The compiled rows of one dtype: rates, ratios by wall and CPU time, the `--ab-compiled` A/B if run, and the
    compile seconds spent during the timed steps (recompiles)."""
    tps = {who: tokens / statistics.median(times[who]) for who in times}
    cpu = {who: statistics.median(t) for who, t in cpu_times.items()}
    print(f"\n[{name}] compiled blocks: ours {tps['ours_compiled']:,.0f} tok/s "
          f"(warm-up {warmups['ours_compiled']:.0f} s) | HF {tps['hf_compiled']:,.0f} tok/s "
          f"(warm-up {warmups['hf_compiled']:.0f} s) | ours compiled / HF eager "
          f"{tps['ours_compiled'] / tps['hf']:.2f}x, "
          f"/ HF compiled {tps['ours_compiled'] / tps['hf_compiled']:.2f}x,"
          f" ours compiled / ours eager {tps['ours_compiled'] / tps['ours']:.2f}x; "
          f"MFU ours compiled {tps['ours_compiled'] * flops_tok / ceiling:.1%}, "
          f"HF compiled {tps['hf_compiled'] * flops_tok / ceiling:.1%}")
    print(f"[{name}] by CPU time: ours compiled / HF compiled {cpu['hf_compiled'] / cpu['ours_compiled']:.2f}x, "
          f"ours eager / HF eager {cpu['hf'] / cpu['ours']:.2f}x")
    if "ours_compiled_off" in times:
        off, on = cpu_times["ours_compiled_off"], cpu_times["ours_compiled"]
        per_round = statistics.median(f / n for f, n in zip(off, on, strict=True))
        print(f"[{name}] compiled without {option}: {tps['ours_compiled_off']:,.0f} tok/s (warm-up "
              f"{warmups['ours_compiled_off']:.0f} s); CPU s/step {cpu['ours_compiled_off']:.3f} vs "
              f"{cpu['ours_compiled']:.3f} with: without/with {cpu['ours_compiled_off'] / cpu['ours_compiled']:.2f}x "
              f"(median per-round ratio {per_round:.2f}x); without / HF compiled (CPU time) "
              f"{cpu['hf_compiled'] / cpu['ours_compiled_off']:.2f}x")
    after = compile_seconds()
    if after is not None and compiled_before is not None:
        print(f"[{name}] compile seconds during the timed steps: {after - compiled_before:.1f} (0: no recompile)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help=f"per dtype, stop timing after this many seconds (but never below {MIN_REPEATS} "
                        "repeats); bounds the bf16 leg on CPUs without native bf16")
    parser.add_argument("--hf-experts", default="auto", help="HF experts_implementation, or auto (fastest)")
    parser.add_argument("--ceiling-n", type=int, default=1024, help="matmul size n of the ceiling")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--profile", type=int, default=0, metavar="K",
                        help="also print our step's top K ops by self CPU time, forward and backward apart")
    parser.add_argument("--profile-dtype", default="fp32", choices=list(DTYPES), help="dtype of --profile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true",
                        help="also time both models with each decoder block torch.compiled (regional compile: "
                        "ours via openk2.model.compile.compile_blocks, HF's layers the same way)")
    parser.add_argument("--ab-compiled", choices=sorted(COMPILED_AB_OPTIONS), default=None, metavar="OPTION",
                        help="with --compile, also time ours compiled with OPTION off (the path before it: "
                        f"{', '.join(sorted(COMPILED_AB_OPTIONS))}), alternating with the other rows")
    args = parser.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtype(s) {unknown}; choose from {list(DTYPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    transformers = quiet_transformers()
    started = time.perf_counter()
    print(f"machine: {machine_summary()}")
    cfg = ModelConfig.preset(args.preset)
    torch.manual_seed(args.seed)
    ours32 = K2ForCausalLM(cfg).train()
    hf32 = load_hf(ours32, "grouped_mm" if args.hf_experts == "auto" else args.hf_experts)

    gen = torch.Generator().manual_seed(args.seed + 1)
    n_steps = args.warmup + args.repeats
    batches = [torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen)
               for _ in range(n_steps)]

    with torch.no_grad():
        ours_loss = ours32(batches[0], labels=batches[0]).loss.item()
        hf_loss = hf32(batches[0], labels=batches[0], **hf_step_kwargs()).loss.item()
    rel = abs(ours_loss - hf_loss) / abs(hf_loss)
    print(f"fp32 loss on batch 0: ours {ours_loss:.6f}  HF {hf_loss:.6f}  rel diff {rel:.1e}")
    assert rel <= 1e-4, f"models disagree: ours {ours_loss} vs HF {hf_loss}"

    if args.hf_experts == "auto":
        experts, report = pick_hf_experts(hf32, args.seq_len, cfg.vocab_size)
        print("HF experts_implementation probe (1 x seq_len, fp32): "
              + ", ".join(f"{k}: {v}" for k, v in report.items()))
    else:
        experts = args.hf_experts
    hf32.set_experts_implementation(experts)
    print(f"HF: DeepseekV3ForCausalLM, attn_implementation=sdpa, experts_implementation={experts} "
          f"(transformers {transformers.__version__})")

    counts = cfg.num_params()
    flops_tok = training_flops_per_token(cfg, args.seq_len)
    tokens = args.batch_size * args.seq_len
    print(f"preset {args.preset}: {counts.total / 1e6:.2f}M params, {counts.activated / 1e6:.2f}M activated; "
          f"batch {args.batch_size} x {args.seq_len} = {tokens} tokens/step; "
          f"{flops_tok / 1e6:.2f} MFLOP/token (fwd+bwd); warmup {args.warmup}, repeats {args.repeats}")
    if args.profile:
        dtype = DTYPES[args.profile_dtype]
        profile_step(ours32 if dtype == torch.float32 else copy.deepcopy(ours32).to(dtype), batches[0], args.profile)

    rows = []
    for name in dtypes:
        dtype = DTYPES[name]
        ours = ours32 if dtype == torch.float32 else copy.deepcopy(ours32).to(dtype)
        hf = hf32 if dtype == torch.float32 else copy.deepcopy(hf32).to(dtype)
        steps = {"ours": lambda ids, m=ours: train_step(m, ids),
                 "hf": lambda ids, m=hf: train_step(m, ids, **hf_step_kwargs())}
        warmups = {}
        if args.compile:
            steps.update(compiled_steps(ours, hf, batches[0], warmups, ab_option=args.ab_compiled))
        compiled_before = compile_seconds()
        times: dict[str, list[float]] = {who: [] for who in steps}
        cpu_times: dict[str, list[float]] = {who: [] for who in steps}  # process CPU seconds per step
        losses, timed_start, stopped_early = {}, 0.0, False
        for i, ids in enumerate(batches):
            done = i - args.warmup
            if done == 0:
                timed_start = time.perf_counter()
            elif done >= MIN_REPEATS:
                spent = time.perf_counter() - timed_start
                if spent + spent / done > args.max_seconds:  # the next pair would overrun the budget
                    stopped_early = True
                    break
            order = list(steps)
            for who in order if i % 2 == 0 else order[::-1]:
                start, cpu_start = time.perf_counter(), time.process_time()
                loss = steps[who](ids)
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
                if i == 0:
                    losses[who] = loss
                if i >= args.warmup:
                    times[who].append(elapsed)
                    cpu_times[who].append(cpu)
        ceiling = measure_matmul_peak(dtype, size=args.ceiling_n, repeats=5)
        ours_tps = tokens / statistics.median(times["ours"])
        hf_tps = tokens / statistics.median(times["hf"])
        cpu_ratio = statistics.median(cpu_times["hf"]) / statistics.median(cpu_times["ours"])
        row = dict(dtype=name, ours=ours_tps, hf=hf_tps, ratio=ours_tps / hf_tps, cpu_ratio=cpu_ratio,
                   ours_flops=ours_tps * flops_tok, hf_flops=hf_tps * flops_tok, ceiling=ceiling)
        rows.append(row)
        if args.compile:
            print_compiled(name, times, cpu_times, warmups, tokens, flops_tok, ceiling, compiled_before,
                           args.ab_compiled)
        spread = {w: f"{min(t):.2f}-{max(t):.2f} s" for w, t in times.items()}
        note = f" (stopped early: --max-seconds {args.max_seconds:g})" if stopped_early else ""
        print(f"\n[{name}] {len(times['ours'])} timed steps each{note}; "
              f"step time range ours {spread['ours']}, HF {spread['hf']}; "
              f"loss batch 0 ours {losses['ours']:.4f} HF {losses['hf']:.4f}")
        print(f"[{name}] ours {ours_tps:,.0f} tok/s | HF {hf_tps:,.0f} tok/s | ours/HF {row['ratio']:.2f}x")
        cpu_line = ", ".join(f"{who} {statistics.median(t):.3f} s" for who, t in cpu_times.items())
        print(f"[{name}] process CPU time per step (median; with --threads 1 robust to other processes' load): "
              f"{cpu_line}; HF/ours {cpu_ratio:.2f}x")
        print(f"[{name}] ours {row['ours_flops'] / 1e9:.2f} GFLOP/s, MFU {row['ours_flops'] / ceiling:.1%} | "
              f"HF {row['hf_flops'] / 1e9:.2f} GFLOP/s, MFU {row['hf_flops'] / ceiling:.1%} | "
              f"ceiling {ceiling / 1e9:.1f} GFLOP/s ({args.ceiling_n}x{args.ceiling_n} @ W^T, {name})")

    print(f"\nmachine after: {machine_summary()}")
    print(f"total {time.perf_counter() - started:.0f} s\n")
    print("| dtype | ours tok/s | HF tok/s | ours/HF | ours/HF (CPU time) | ours GFLOP/s | ours MFU | HF MFU | "
          "matmul ceiling GFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['ours']:,.0f} | {r['hf']:,.0f} | {r['ratio']:.2f}x | {r['cpu_ratio']:.2f}x | "
              f"{r['ours_flops'] / 1e9:.2f} | {r['ours_flops'] / r['ceiling']:.1%} | "
              f"{r['hf_flops'] / r['ceiling']:.1%} | {r['ceiling'] / 1e9:.1f} |")


if __name__ == "__main__":
    main()
