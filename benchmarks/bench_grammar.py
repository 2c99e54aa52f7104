"""Constrained-decoding libraries on openk2's tokenizer: grammar compile time and per-token mask time.

For each importable library (llguidance, xgrammar) and one nested tool-argument JSON schema, this compiles the
schema against a byte-level BPE vocabulary trained here (`--vocab` ids, K2's special block included), then walks
`--samples` random sequences through the grammar: at every step it computes the allowed-token mask, draws a token
among the allowed ones from random logits and advances the matcher, until the grammar is complete. Reported:
compile seconds (median over samples; a fresh compile each), mask microseconds per token (median over all
steps), and how many finished samples parse and validate against the schema (jsonschema); samples still open
after 400 tokens (the schema leaves integers unbounded) are counted apart.

Usage: python benchmarks/bench_grammar.py --vocab 4096 --samples 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema
import torch

from openk2.data.tokenizer import train_tokenizer
from openk2.infer.grammar import token_bytes

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Beijing", "New York"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"type": "string", "enum": ["metric", "imperial"]},
        "stops": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12}, "nights": {"type": "integer"}},
            "required": ["name"], "additionalProperties": False}, "maxItems": 3},
        "notes": {"type": "string", "maxLength": 20},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def corpus() -> list[str]:
    from openk2.data.mathgen import math_documents

    words = "the quick brown fox jumps over lazy dog city Paris Beijing metric imperial days notes name nights"
    docs = [f'{words} {{"city": "Paris", "days": {i}, "stops": [{{"name": "x{i}"}}]}} ' * 4 for i in range(50)]
    return docs + list(math_documents(seed=0, count=3000))


def bits_to_bool(mask_W: torch.Tensor, vocab: int) -> torch.Tensor:
    return ((mask_W[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab].bool()


def walk(name: str, tok, samples: int, seed: int) -> dict:
    vocab = tok.vocab_size
    compile_s, mask_us, valid, unfinished = [], [], 0, 0
    gen = torch.Generator().manual_seed(seed)
    if name == "llguidance":
        import llguidance
        import llguidance.torch as lgt

        from openk2.infer.grammar import lltokenizer
        lt = lltokenizer(tok)
        schema = dict(SCHEMA, **{"x-guidance": {"whitespace_flexible": False}})
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    else:
        import xgrammar as xgr
        info = xgr.TokenizerInfo(token_bytes(tok), vocab_type=xgr.VocabType.RAW, vocab_size=vocab,
                                 stop_token_ids=[tok.eos_id])
    for _ in range(samples):
        start = time.perf_counter()
        if name == "llguidance":
            matcher = llguidance.LLMatcher(lt, grammar)
            mask = lgt.allocate_token_bitmask(1, vocab)
        else:
            compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
                json.dumps(SCHEMA), any_whitespace=False)
            matcher = xgr.GrammarMatcher(compiled)
            mask = xgr.allocate_token_bitmask(1, vocab)
        compile_s.append(time.perf_counter() - start)
        out: list[int] = []
        finished = False
        for _ in range(400):
            start = time.perf_counter()
            if name == "llguidance":
                lgt.fill_next_token_bitmask(matcher, mask)
            else:
                matcher.fill_next_token_bitmask(mask)
            mask_us.append((time.perf_counter() - start) * 1e6)
            allowed = bits_to_bool(mask[0], vocab)
            logits = torch.randn(vocab, generator=gen).masked_fill(~allowed, float("-inf"))
            t = int(logits.argmax())
            if t == tok.eos_id:
                finished = True
                break
            ok = matcher.consume_token(t) if name == "llguidance" else matcher.accept_token(t)
            assert ok, f"{name} refused a token its own mask allowed"
            out.append(t)
            done = matcher.is_stopped() if name == "llguidance" else matcher.is_terminated()
            if done:
                finished = True
                break
        if not finished:  # the 400-step cap: an unbounded integer or string (the schema has no cap on it)
            unfinished += 1
            continue
        try:
            jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as err:
            print(f"  {name}: invalid sample ({type(err).__name__}): {tok.decode(out)[:120]!r}")
    return {"compile_ms": 1e3 * statistics.median(compile_s), "mask_us": statistics.median(mask_us),
            "valid": f"{valid}/{samples - unfinished}", "unfinished": unfinished}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = train_tokenizer(corpus(), vocab_size=args.vocab)
    print(f"tokenizer: {tok.vocab_size} ids ({tok.num_base_tokens} BPE)")
    print("| library | compile ms (median) | mask us/token (median) | schema-valid / finished | unfinished |")
    print("|---|---:|---:|---:|---:|")
    for name in ("llguidance", "xgrammar"):
        try:
            __import__(name)
        except ImportError:
            print(f"| {name} | not installed | | |")
            continue
        r = walk(name, tok, args.samples, args.seed)
        print(f"| {name} | {r['compile_ms']:.1f} | {r['mask_us']:.0f} | {r['valid']} | {r['unfinished']} |")


if __name__ == "__main__":
    main()
