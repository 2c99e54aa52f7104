"""A synthesis run with every batched `generate` of the `hf:` backend profiled: call kinds in the batch, CPU
seconds of its thread, model forwards split into prefill and decode (forward hooks), the grammar's
`LogitsProcessor`, prompt tokens, tokens not prefilled again and positions prefilled. One JSON line per batch in
OUT/batches.jsonl; the run itself is `SynthPipeline(cfg, OUT/run).run()`, as `openk2 synth run` does it.

Usage: OMP_NUM_THREADS=1 nice -n 10 python benchmarks/profile_synth.py configs/synth-ci.toml OUT [SECTION.KEY=VALUE ...]
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
from pathlib import Path

import openk2.llm.hf_backend as hb
import openk2.llm.hf_grammar as hg
from openk2.agentic import users

_TL = threading.local()
_OUT: Path | None = None


def _kind(plan: object, messages: list[dict]) -> str:
    system = (messages[0].get("content") or "") if messages else ""
    if plan.grammar is not None and plan.grammar[2] == "call":
        return "agent_call"
    if plan.tools:
        return "agent_turn"
    if system.startswith(users.INSTRUCTIONS[:40]):
        return "user"
    if system.startswith("You are a strict judge"):
        return "judge"
    return "generator"


def _install() -> None:
    plan_orig, call_orig, gen_orig = hb.HFChatModel._plan, hg.GrammarLogits.__call__, hb.HFChatModel._generate
    hooked: set[int] = set()

    def plan(self, messages, tools, sampling):
        p = plan_orig(self, messages, tools, sampling)
        p._kind = _kind(p, list(messages))
        return p

    def grammar_call(self, ids, scores):
        t0 = time.thread_time()
        try:
            return call_orig(self, ids, scores)
        finally:
            _TL.grammar += time.thread_time() - t0

    def pre(mod, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        _TL.start, _TL.shape = time.thread_time(), (int(ids.shape[0]), int(ids.shape[1]))

    def post(mod, args, kwargs, out):
        rows, width = _TL.shape
        key = "prefill" if width > 1 else "decode"
        _TL.fw[key + "_cpu"] += time.thread_time() - _TL.start
        _TL.fw[key + "_n"] += 1
        _TL.fw[key + "_tok"] += rows * width

    def generate(self, plans):
        if id(self.model) not in hooked:
            hooked.add(id(self.model))
            self.model.register_forward_pre_hook(pre, with_kwargs=True)
            self.model.register_forward_hook(post, with_kwargs=True)
        _TL.grammar, _TL.fw = 0.0, collections.Counter()
        shared0 = self.prefix_stats["shared_tokens"]
        t0, w0 = time.thread_time(), time.perf_counter()
        result = gen_orig(self, plans)
        record = {"t": time.time(), "wall": time.perf_counter() - w0, "cpu": time.thread_time() - t0,
                  "rows": len(plans), "kinds": collections.Counter(getattr(p, "_kind", "?") for p in plans),
                  "prompt_tok": sum(len(p.prompt) for p in plans), "max_prompt": max(len(p.prompt) for p in plans),
                  "shared": self.prefix_stats["shared_tokens"] - shared0, "budget": max(p.max_tokens for p in plans),
                  "gen_tok": sum(r[0].usage["completion_tokens"] for r in result), "g_cpu": _TL.grammar, **_TL.fw}
        with open(_OUT / "batches.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        return result

    hb.HFChatModel._plan, hg.GrammarLogits.__call__, hb.HFChatModel._generate = plan, grammar_call, generate


def main() -> None:
    global _OUT
    from openk2.agentic.pipeline import SynthPipeline
    from openk2.agentic.synth_config import load_synth_config

    _OUT = Path(sys.argv[2])
    _OUT.mkdir(parents=True, exist_ok=True)
    _install()
    cfg = load_synth_config(sys.argv[1], sys.argv[3:])
    t0, c0 = time.perf_counter(), time.process_time()
    stats = SynthPipeline(cfg, _OUT / "run").run()
    print("WALL", round(time.perf_counter() - t0, 1), "CPU", round(time.process_time() - c0, 1))
    print(json.dumps({k: v for k, v in stats.items() if k not in ("stages", "tools")}, indent=1))


if __name__ == "__main__":
    main()
