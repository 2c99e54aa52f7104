"""Greedy decode throughput of openk2's Engine (latent KV cache, absorbed MLA) against transformers' generate.

One process builds our model from a preset, writes it with `save_pretrained`, loads the checkpoint into HF's
DeepseekV3ForCausalLM (dtype float32, its default attention and experts implementations) and, for each prompt
length, generates N = `--new-tokens` greedy tokens for the same `--batch-size` random prompts (all of that length,
so HF needs no padding) with both. Both are asserted to produce the same tokens, so the comparison is apples to
apples. Each call is stamped when it starts and when each new token of the batch exists -- ours after every
`Engine.step()` (step 1 prefills and yields token 1, each later step decodes one token), HF through a `streamer`
whose `put` generate calls with every new token -- so one call gives:

    prefill s        = stamp(token 1) - stamp(start)
    decode tok/s     = batch * (N - 1) / (stamp(token N) - stamp(token 1))     (N - 1 decode steps)
    end-to-end tok/s = batch * N / (stamp(token N) - stamp(start))

The two systems alternate call by call (ours first on even repeats, HF first on odd ones) so drift in machine load
hits both alike; each figure is the median over `--repeats` calls after one warm-up call each. Figures are given
from wall-clock time and from this process's CPU time (time.process_time): with one torch thread (the default
here) the CPU time is the work done, less disturbed by other jobs on a shared machine; with more threads it sums
over threads and only wall-clock time means throughput.

KV-cache bytes per token (all layers): ours from the engine's cache tensor (kv_lora_rank + qk_rope_head_dim
numbers per layer); a per-head cache (H * (qk_head_dim + v_head_dim) per layer) from the K and V tensors our
model's expanded attention builds (MLAttention.qkv) for one prompt; HF's from the tensors its DynamicCache holds
after a generate call. For the kimi-k2 preset the same two layouts are computed analytically, in bf16.

Shared prefix (`--shared-prefix P`, 0 to skip): 8 requests whose prompts are the same P random tokens followed
by 24 tokens of their own are sent one after another to one engine (prefix caching on) and to HF generate; each
request's prefill time is stamped (ours: add_request + the first step, which yields token 1; HF: a generate call
for 1 new token) and its first greedy token compared. Request 1 pays the whole prompt; with prefix reuse the
later ones compute only the blocks past the shared part. Median over `--repeats` rounds, a fresh engine each.

`--decode-compile` adds a third system, our engine with `decode_compile=True` (infer/compiled_decode.py: the decode
step as one inductor graph per batch bucket): its first call per prompt length is its warm-up, which compiles (the
wall time of the compiling step is printed), its tokens are asserted equal to HF's too, and it joins the
alternation (the order rotates by repeat).

Usage: python benchmarks/bench_infer.py --preset tiny --batch-size 8 --prompt-lens 64,256,1024 --new-tokens 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hf_copy, machine_summary, quiet_transformers  # noqa: E402

from openk2 import K2ForCausalLM, ModelConfig  # noqa: E402
from openk2.infer.engine import Engine, SamplingParams  # noqa: E402
from openk2.infer.kv_cache import PagedLatentCache  # noqa: E402

CLOCKS = ("wall", "cpu")


def stamp() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


class StampStreamer:
    """An HF generate streamer that only records when each batch of new tokens arrives."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = []
        self.tokens: list[torch.Tensor] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(stamp())
        self.tokens.append(value)

    def end(self) -> None:
        pass


def rates(stamps: list[tuple[float, float]], batch: int) -> dict[str, float]:
    """Figures of one call from its stamps [start, token 1, ..., token N], for both clocks."""
    n = len(stamps) - 1
    out = {}
    for k, clock in enumerate(CLOCKS):
        start, first, last = stamps[0][k], stamps[1][k], stamps[-1][k]
        out[f"{clock}_prefill_s"] = first - start
        out[f"{clock}_decode"] = batch * (n - 1) / max(last - first, 1e-9)
        out[f"{clock}_e2e"] = batch * n / max(last - start, 1e-9)
    return out


def latent_bytes_per_token(cfg: ModelConfig, bytes_per_number: int) -> int:
    return cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * bytes_per_number


def per_head_bytes_per_token(cfg: ModelConfig, bytes_per_number: int) -> int:
    return cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * bytes_per_number


@torch.no_grad()
def measured_per_head_bytes(model: K2ForCausalLM, ids: torch.Tensor) -> int:
    """Bytes per token of the per-head K and V that the expanded attention materialises, summed over layers."""
    inner = model.model
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    cos, sin = inner.rotary_emb(positions)
    x = inner.embed_tokens(ids)
    total = 0
    for layer in inner.layers:
        h = layer.input_layernorm(x)
        _, k, v = layer.self_attn.qkv(h, cos, sin)
        total += k.nbytes + v.nbytes
        x = layer(x, cos, sin)
    return total // ids.numel()


def hf_cache_bytes_per_token(past, tokens: int) -> int | None:
    """Bytes per cached token of an HF cache object's tensors (None if its layout is not recognised)."""
    layers = getattr(past, "layers", None)
    if not layers:
        return None
    total = 0
    for layer in layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.nbytes
    return total // tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-lens", default="64,256,1024", help="comma-separated prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (0: torch's default); 1 by default because on a small shared machine "
                        "a second intra-op thread turns these millisecond-sized steps into contention outliers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shared-prefix", type=int, default=1000, help="tokens shared by 8 requests (0: skip)")
    parser.add_argument("--step-ab", type=int, default=0, metavar="ROUNDS",
                        help="also time the engine's decode step with fast_decode on and off, alternating, "
                        "ROUNDS rounds at the first prompt length (0: skip)")
    parser.add_argument("--fast-decode", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine's fused one-token decode step (infer/decode_step.py); --no-fast-decode "
                        "runs every step through the model's modules")
    parser.add_argument("--decode-compile", action="store_true",
                        help="also time Engine(decode_compile=True) (one compiled graph per batch bucket)")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (decode is timed from token 1 to token N)")
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt_lens = [int(p) for p in args.prompt_lens.split(",") if p.strip()]

    started = time.perf_counter()
    print(f"machine: {machine_summary()}")
    cfg = ModelConfig.preset(args.preset)
    torch.manual_seed(args.seed)
    ours = K2ForCausalLM(cfg).eval()
    hf = hf_copy(ours).eval()
    transformers = quiet_transformers()
    hf_attn = hf.config._attn_implementation
    hf_experts = getattr(hf.config, "_experts_implementation", "?")
    print(f"HF: DeepseekV3ForCausalLM fp32, attn_implementation={hf_attn}, experts_implementation={hf_experts} "
          f"(transformers {transformers.__version__}); ours: Engine fp32, absorbed decode, "
          f"fast_decode={args.fast_decode}")
    print(f"preset {args.preset}, batch {args.batch_size}, {args.new_tokens} new tokens, greedy, "
          f"1 warm-up + {args.repeats} timed calls each per prompt length, {torch.get_num_threads()} torch thread(s)")

    gen = torch.Generator().manual_seed(args.seed + 1)
    rows = []
    hf_cache_bpt = None
    engine_cache_bpt = None
    for plen in prompt_lens:
        ids = torch.randint(0, cfg.vocab_size, (args.batch_size, plen), generator=gen)
        prompts = ids.tolist()
        # No prefix caching here: the repeated calls send the same prompts, which would make prefill free.
        engine = Engine(ours, max_batch_size=args.batch_size, max_seq_len=plen + args.new_tokens, prefix_caching=False,
                        fast_decode=args.fast_decode)
        engine_cache_bpt = engine.cache.bytes_per_token
        compiled = Engine(ours, max_batch_size=args.batch_size, max_seq_len=plen + args.new_tokens,
                          prefix_caching=False, decode_compile=True) if args.decode_compile else None

        def run_ours(engine=engine, prompts=prompts) -> tuple[list[list[int]], list[tuple[float, float]]]:
            stamps = [stamp()]
            params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
            order = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
            results = []
            while engine.has_unfinished():
                results += engine.step()
                stamps.append(stamp())
            results.sort(key=lambda r: order[r.request_id])
            return [r.token_ids for r in results], stamps

        def run_hf(ids=ids, **kwargs):
            streamer = StampStreamer()
            stamps = [stamp()]
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0,
                                  streamer=streamer, **kwargs)
            # put #0 is the prompt, sent before the prefill: the call's start is stamped before generate instead.
            return out, stamps + streamer.stamps[1:]

        ours_tokens, ours_stamps = run_ours()
        hf_out, hf_stamps = run_hf(return_dict_in_generate=True)
        hf_tokens = hf_out.sequences[:, plen:].tolist()
        assert len(ours_stamps) == len(hf_stamps) == args.new_tokens + 1, (len(ours_stamps), len(hf_stamps))
        same = sum(a == b for a, b in zip(ours_tokens, hf_tokens, strict=True))
        assert ours_tokens == hf_tokens, f"greedy tokens differ at prompt length {plen}: {same}/{len(prompts)} same"
        hf_cache_bpt = hf_cache_bytes_per_token(hf_out.past_key_values, args.batch_size * (plen + args.new_tokens - 1))

        calls = {"ours": lambda: run_ours()[1], "hf": lambda: run_hf()[1]}
        row: dict = {"plen": plen}
        if compiled is not None:
            start = time.perf_counter()
            compiled_tokens, _ = run_ours(compiled)
            row["compile_s"] = max(compiled.decode_compile_seconds.values())
            print(f"\n[prompt {plen}] compiled decode: first call {time.perf_counter() - start:.1f} s, its "
                  f"compiling step {row['compile_s']:.1f} s (buckets {sorted(compiled.decode_compile_seconds)})")
            assert compiled_tokens == hf_tokens, f"compiled decode's greedy tokens differ at prompt length {plen}"
            calls["compiled"] = lambda compiled=compiled: run_ours(compiled)[1]
        names = list(calls)
        figures: dict[str, list[dict[str, float]]] = {who: [] for who in names}
        for rep in range(args.repeats + 1):
            for i in range(len(names)):
                who = names[(i + rep) % len(names)]  # the order rotates by repeat
                stamps = calls[who]()
                if rep:  # round 0 warms up
                    figures[who].append(rates(stamps, args.batch_size))
        for who in names:
            for key in figures[who][0]:
                row[(who, key)] = statistics.median(f[key] for f in figures[who])
        for clock in CLOCKS:
            for kind in ("decode", "e2e"):
                for who, tag in (("ours", "ratio"), ("compiled", "cratio")):
                    if who in calls:
                        row[(tag, f"{clock}_{kind}")] = row[(who, f"{clock}_{kind}")] / row[("hf", f"{clock}_{kind}")]
        rows.append(row)
        print(f"\n[prompt {plen}] greedy tokens identical for {same}/{len(prompts)} prompts")
        for who in names:
            spread = ", ".join(f"{f['wall_decode']:,.0f}" for f in figures[who])
            print(f"[prompt {plen}] {who:4s}: decode tok/s (wall) {spread} | median prefill "
                  f"{row[(who, 'wall_prefill_s')]:.3f} s | decode {row[(who, 'wall_decode')]:,.0f} tok/s wall, "
                  f"{row[(who, 'cpu_decode')]:,.0f} CPU | end-to-end {row[(who, 'wall_e2e')]:,.0f} tok/s wall")
        print(f"[prompt {plen}] ours/HF: decode {row[('ratio', 'wall_decode')]:.2f}x wall, "
              f"{row[('ratio', 'cpu_decode')]:.2f}x CPU | end-to-end {row[('ratio', 'wall_e2e')]:.2f}x wall, "
              f"{row[('ratio', 'cpu_e2e')]:.2f}x CPU")
        if compiled is not None:
            print(f"[prompt {plen}] compiled/HF: decode {row[('cratio', 'wall_decode')]:.2f}x wall, "
                  f"{row[('cratio', 'cpu_decode')]:.2f}x CPU | end-to-end {row[('cratio', 'wall_e2e')]:.2f}x wall")

    prefix_rows = shared_prefix(ours, hf, cfg, args.shared_prefix, args.repeats, gen) if args.shared_prefix else []
    if args.step_ab:
        decode_step_ab(ours, cfg, args.batch_size, prompt_lens[0], args.new_tokens, args.step_ab, gen)

    # ---------------------------------------------------------------- KV-cache bytes per token
    probe = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    per_head_measured = measured_per_head_bytes(ours, probe)
    bf16_latent = PagedLatentCache(cfg, 1, 1, dtype=torch.bfloat16).bytes_per_token
    k2 = ModelConfig.preset("kimi-k2")
    k2_latent, k2_heads = latent_bytes_per_token(k2, 2), per_head_bytes_per_token(k2, 2)
    print(f"\nKV cache bytes/token, {args.preset} preset fp32 (measured from tensors): ours latent "
          f"{engine_cache_bpt:,} (bf16 {bf16_latent:,}) | per-head K+V {per_head_measured:,} | "
          f"ratio {per_head_measured / engine_cache_bpt:.2f}x | HF DynamicCache {hf_cache_bpt}")
    print(f"KV cache bytes/token, kimi-k2 bf16 (analytic, {k2.num_hidden_layers} layers): latent "
          f"{k2.kv_lora_rank}+{k2.qk_rope_head_dim} -> {k2_latent:,} B | per-head {k2.num_attention_heads} x "
          f"({k2.qk_head_dim}+{k2.v_head_dim}) -> {k2_heads:,} B | ratio {k2_heads / k2_latent:.2f}x | "
          f"128K-token sequence: {k2_latent * 131072 / 2**30:.1f} GiB vs {k2_heads * 131072 / 2**30:.1f} GiB")

    print(f"\nmachine after: {machine_summary()}")
    print(f"total {time.perf_counter() - started:.0f} s\n")
    print("| prompt | ours decode tok/s | HF decode tok/s | decode ours/HF (wall) | decode ours/HF (CPU) | "
          "ours prefill s | HF prefill s | end-to-end ours/HF (wall) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['plen']} | {r[('ours', 'wall_decode')]:,.0f} | {r[('hf', 'wall_decode')]:,.0f} | "
              f"{r[('ratio', 'wall_decode')]:.2f}x | {r[('ratio', 'cpu_decode')]:.2f}x | "
              f"{r[('ours', 'wall_prefill_s')]:.3f} | {r[('hf', 'wall_prefill_s')]:.3f} | "
              f"{r[('ratio', 'wall_e2e')]:.2f}x |")

    if args.decode_compile:
        print("\n| prompt | ours eager decode tok/s | ours compiled | HF | eager/HF (wall / CPU) | "
              "compiled/HF (wall / CPU) | compiling step s |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['plen']} | {r[('ours', 'wall_decode')]:,.0f} | {r[('compiled', 'wall_decode')]:,.0f} | "
                  f"{r[('hf', 'wall_decode')]:,.0f} | {r[('ratio', 'wall_decode')]:.2f}x / "
                  f"{r[('ratio', 'cpu_decode')]:.2f}x | {r[('cratio', 'wall_decode')]:.2f}x / "
                  f"{r[('cratio', 'cpu_decode')]:.2f}x | {r['compile_s']:.1f} |")

    if prefix_rows:
        print(f"\nshared prefix of {args.shared_prefix} tokens + 24 own tokens, 8 requests one after another "
              f"(median of {args.repeats} rounds):")
        print("| request | ours prefill s | tokens computed | HF prefill s | ours/HF prefill time |")
        print("|---:|---:|---:|---:|---:|")
        for i, (ours_s, computed, hf_s) in enumerate(prefix_rows):
            print(f"| {i + 1} | {ours_s:.4f} | {computed} | {hf_s:.4f} | {ours_s / hf_s:.3f} |")


def decode_step_ab(ours: K2ForCausalLM, cfg: ModelConfig, batch: int, plen: int, new_tokens: int, rounds: int,
                   gen: torch.Generator) -> None:
    """Print the median CPU ms per decode step of the engine with fast_decode on and off (same prompts; the two
    alternate call by call, which one goes first alternating by round; one warm-up call each)."""
    prompts = torch.randint(0, cfg.vocab_size, (batch, plen), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engines = {flag: Engine(ours, max_batch_size=batch, max_seq_len=plen + new_tokens, prefix_caching=False,
                            fast_decode=flag) for flag in (True, False)}
    ms: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(rounds + 1):
        for flag in ((True, False) if rep % 2 == 0 else (False, True)):
            engine = engines[flag]
            for p in prompts:
                engine.add_request(p, params)
            engine.step()  # prefill + token 1
            start = time.process_time()
            while engine.has_unfinished():
                engine.step()
            if rep:
                ms[flag].append((time.process_time() - start) / (new_tokens - 1) * 1e3)
    on, off = statistics.median(ms[True]), statistics.median(ms[False])
    print(f"\ndecode step A/B, prompt {plen}, batch {batch}, {rounds} alternating rounds: fast_decode on "
          f"{on:.2f} ms, off {off:.2f} ms (CPU, median) -> {off / on:.2f}x; per round on "
          f"{', '.join(f'{x:.1f}' for x in ms[True])} | off {', '.join(f'{x:.1f}' for x in ms[False])}")


def shared_prefix(ours: K2ForCausalLM, hf, cfg: ModelConfig, prefix_len: int, repeats: int,
                  gen: torch.Generator) -> list[tuple[float, int, float]]:
    """Per request: median prefill seconds (ours), prompt tokens ours computed, median prefill seconds (HF)."""
    own = 24
    prefix = torch.randint(0, cfg.vocab_size, (prefix_len,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, cfg.vocab_size, (own,), generator=gen).tolist() for _ in range(8)]
    ours_s: list[list[float]] = [[] for _ in prompts]
    hf_s: list[list[float]] = [[] for _ in prompts]
    computed = [0] * len(prompts)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for rep in range(repeats + 1):
        engine = Engine(ours, max_batch_size=8, max_seq_len=prefix_len + own + 1)
        for i, prompt in enumerate(prompts):
            before = engine.prefill_tokens_computed
            start = time.perf_counter()
            engine.add_request(prompt, params)
            (result,) = engine.step()  # prefill; max_tokens=1 ends the request with token 1
            took = time.perf_counter() - start
            ids = torch.tensor([prompt])
            start = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=1,
                                  min_new_tokens=1, pad_token_id=0)
            hf_took = time.perf_counter() - start
            assert out[0, -1].item() == result.token_ids[0], f"first greedy token differs for request {i + 1}"
            if rep:  # round 0 warms up
                ours_s[i].append(took)
                hf_s[i].append(hf_took)
                computed[i] = engine.prefill_tokens_computed - before
    return [(statistics.median(o), c, statistics.median(h)) for o, c, h in zip(ours_s, computed, hf_s, strict=True)]


if __name__ == "__main__":
    main()
