"""`openk2 sft`: fine-tune a checkpoint on chat/tool-use conversations (and a share of pre-training text) and
score its tool calls and corpus perplexity before and after."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from types import SimpleNamespace

import torch

from openk2.cli.args import add_resume_argument, add_set_argument, positive_int
from openk2.eval.base import EvalContext
from openk2.eval.perplexity import PerplexityBenchmark
from openk2.model import K2ForCausalLM
from openk2.train.config import load_run_config
from openk2.train.sft import EVAL_FILE, SFTTrainer, sft_run_config, write_json
from openk2.train.toolcall_eval import ToolCallScore
from openk2.train.trainer import BadStepError


def sft_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="openk2 sft",
        description="Fine-tune a checkpoint on chat/tool-use conversations (loss on assistant tokens, MuonClip), "
                    "and report the well-formed K2 tool-call rate on held-out prompts before and after.")
    parser.add_argument("--config", required=True, help="TOML run config with an [sft] table (configs/sft-tiny.toml)")
    parser.add_argument("--out", help="run directory (default: out_dir from the config)")
    parser.add_argument("--init-from", help="checkpoint or pre-training run directory (overrides sft.init_from)")
    parser.add_argument("--max-steps", type=positive_int, help="stop after this step without changing the schedule")
    add_resume_argument(parser)
    add_set_argument(parser, "sft.generate=500")
    args = parser.parse_args(argv)
    overrides = list(args.set) + ([f"sft.init_from={json.dumps(args.init_from)}"] if args.init_from else [])
    cfg, init = sft_run_config(load_run_config(args.config, overrides))
    print(f"fine-tuning {init}", file=sys.stderr)

    trainer = SFTTrainer(cfg, init, out_dir=args.out, resume=args.resume)
    eval_path = trainer.out_dir / EVAL_FILE
    record = json.loads(eval_path.read_text()) if args.resume and eval_path.is_file() else {}
    record["init_from"] = str(init)
    if "before" not in record:
        before_model = trainer.model if trainer.step == 0 else K2ForCausalLM.from_pretrained(init, torch.float32)
        _measure(trainer, before_model, record, "before")
        write_json(eval_path, record)
    try:
        summary = trainer.run(max_steps=args.max_steps)
    except BadStepError as err:
        print(f"openk2 sft: {err}", file=sys.stderr)
        return 1
    after = _measure(trainer, trainer.model, record, "after")
    record.update(after_step=summary.step, mixture=trainer.mixture_counts())
    if "perplexity_before" in record and "perplexity_after" in record:
        record["perplexity_factor"] = record["perplexity_after"] / record["perplexity_before"]
    write_json(eval_path, record)

    print(f"\nrun directory: {summary.out_dir}")
    print(f"  step {summary.step}, {summary.tokens_per_s:,.0f} tokens/s (last window, padding included)")
    if summary.val_loss is not None:
        print(f"  validation loss {summary.val_loss:.4f} nats/assistant token; "
              f"unigram baseline {summary.unigram_val_loss:.4f}")
    if "before" in record:
        print(f"  tool calls before: {ToolCallScore(**_score_fields(record['before'])).summary()}")
    if after is not None:
        print(f"  tool calls after:  {after.summary()}")
    if "synth_after" in record:
        print(f"  synthesized tasks: after {ToolCallScore(**_score_fields(record['synth_after'])).summary()}")
    if "perplexity_factor" in record:
        print(f"  corpus perplexity: {record['perplexity_before']:.1f} -> {record['perplexity_after']:.1f} "
              f"(x{record['perplexity_factor']:.2f}; pretrain_fraction {trainer.sft.pretrain_fraction})")
    print(f"  tool-call eval:    {eval_path}")
    print(f"  checkpoint: {summary.checkpoint}")
    print(f"  metrics:    {summary.out_dir / 'metrics.jsonl'}")
    for plot in summary.plots:
        print(f"  plot:       {plot}")
    return 0




def _measure(trainer: SFTTrainer, model: K2ForCausalLM, record: dict, when: str) -> ToolCallScore | None:
    """Score `model` into `record` under `when` ("before"/"after"): procedural and synthesized tool calls and
    the corpus perplexity; returns the procedural score."""
    score = trainer.score_tool_calls(model)
    if score is not None:
        record[when] = score.as_dict()
        print(f"tool calls {when} SFT: {score.summary()}", file=sys.stderr)
    synth = trainer.score_synth_tool_calls(model)
    if synth is not None:
        record[f"synth_{when}"] = synth.as_dict()
        print(f"synthesized tool calls {when} SFT: {synth.summary()}", file=sys.stderr)
    if trainer.sft.perplexity_windows:
        record[f"perplexity_{when}"] = corpus_perplexity(model, trainer)
        print(f"corpus perplexity {when} SFT: {record[f'perplexity_{when}']:.2f}", file=sys.stderr)
    return score


def corpus_perplexity(model: K2ForCausalLM, trainer: SFTTrainer) -> float:
    """The `perplexity` benchmark's number (openk2.eval.perplexity) for `model` on the run's [data] corpus."""
    bench = PerplexityBenchmark(corpus=trainer.cfg.data, windows=trainer.sft.perplexity_windows, bootstrap=0)
    local = SimpleNamespace(engine=SimpleNamespace(model=model), tokenizer=trainer.tokenizer)  # what it reads
    was_training = model.training
    model.eval()
    try:
        verdicts = [bench.evaluate(local, sample, EvalContext()) for sample in bench.samples()]
    finally:
        model.train(was_training)
    return bench.aggregate(verdicts).value


def _score_fields(record: dict) -> dict:
    names = {f.name for f in dataclasses.fields(ToolCallScore)}
    return {k: v for k, v in record.items() if k in names}
