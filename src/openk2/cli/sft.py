"""`openk2 sft`: fine-tune a checkpoint on chat/tool-use conversations and score its tool calls before and after."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from openk2.cli.args import add_resume_argument, add_set_argument, positive_int
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
        before = trainer.score_tool_calls(before_model)
        if before is not None:
            record["before"] = before.as_dict()
            write_json(eval_path, record)
            print(f"tool calls before SFT: {before.summary()}", file=sys.stderr)
    try:
        summary = trainer.run(max_steps=args.max_steps)
    except BadStepError as err:
        print(f"openk2 sft: {err}", file=sys.stderr)
        return 1
    after = trainer.score_tool_calls()
    if after is not None:
        record.update(after=after.as_dict(), after_step=summary.step)
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
        print(f"  tool-call eval:    {eval_path}")
    print(f"  checkpoint: {summary.checkpoint}")
    print(f"  metrics:    {summary.out_dir / 'metrics.jsonl'}")
    for plot in summary.plots:
        print(f"  plot:       {plot}")
    return 0




def _score_fields(record: dict) -> dict:
    names = {f.name for f in dataclasses.fields(ToolCallScore)}
    return {k: v for k, v in record.items() if k in names}
