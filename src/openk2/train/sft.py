"""Supervised fine-tuning (K2 report, section 3.1): continue a pre-trained checkpoint with MuonClip on chat and
tool-use conversations, loss on assistant tokens only, conversations packed but attending only to themselves.

The loop is the pre-training Trainer's (schedule, MuonClip, bad-step handling, metrics, plots, atomic and
resumable checkpoints); `SFTTrainer` only swaps what it is built from: the initial weights and tokenizer come
from `sft.init_from`, batches from a ConversationLoader, and the forward pass takes segment and position ids.
Around the run, `openk2 sft` measures the rate of well-formed K2 tool calls on held-out prompts before and
after, and writes it to `toolcall_eval.json` in the run directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from openk2.config import ModelConfig
from openk2.data import toolchat
from openk2.data.conversations import (
    OVERLONG_POLICIES,
    ConversationLoader,
    TokenizedConversations,
    read_conversations,
    split_conversations,
    tokenize_conversations,
    write_conversations,
)
from openk2.data.unigram import unigram_baseline
from openk2.fileio import atomic_write_text
from openk2.model import K2ForCausalLM
from openk2.train.checkpoint import CheckpointManager, verify_checkpoint
from openk2.train.config import RunConfig, load_run_config
from openk2.train.flops import training_flops_per_token
from openk2.train.toolcall_eval import ToolCallScore, evaluate_tool_calls
from openk2.train.trainer import BadStepError, Trainer

EVAL_FILE = "toolcall_eval.json"
GENERATED_FILE = "toolchat_train.jsonl"


@dataclass(kw_only=True)
class SFTSection:
    """The [sft] table: where the model starts, which conversations it learns, how tool calls are scored."""

    init_from: str | None = None  # a checkpoint dir, or a run dir (its newest complete checkpoint); required
    train_files: list[str] = field(default_factory=list)  # conversation JSONL files
    val_files: list[str] = field(default_factory=list)  # default: val_fraction of the training conversations
    generate: int = 0  # add this many openk2.data.toolchat conversations to the training data
    generate_seed: int = 0
    plain_fraction: float = 0.2  # share of generated conversations that are plain chat (no tool needed)
    val_fraction: float = 0.05
    seq_len: int = 512  # tokens per packed row
    overlong: str = "truncate"  # a conversation longer than seq_len: "truncate" it or "skip" it
    eval_prompts: int = 48  # held-out toolchat prompts for the tool-call rate before/after; 0 turns it off
    eval_seed: int = 0
    eval_max_tokens: int = 64

    def __post_init__(self) -> None:
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"sft.overlong must be one of {OVERLONG_POLICIES}, got {self.overlong!r}")
        if self.seq_len < 2:
            raise ValueError(f"sft.seq_len must be at least 2, got {self.seq_len}")
        if self.generate < 0 or self.eval_prompts < 0:
            raise ValueError("sft.generate and sft.eval_prompts must be non-negative")
        if not self.train_files and self.generate == 0:
            raise ValueError("sft needs training data: set sft.train_files and/or sft.generate")


def resolve_init_checkpoint(path: str | Path | None) -> Path:
    """A checkpoint directory as given, or the newest complete checkpoint of a run directory."""
    if path is None:
        raise ValueError("sft.init_from is not set (a checkpoint or a pre-training run directory)")
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"sft.init_from {path} is not a directory")
    if not (path / "config.json").is_file():
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        latest = CheckpointManager(root).latest()
        if latest is None:
            raise ValueError(f"sft.init_from {path} holds no model (config.json) and no complete checkpoint")
        path = latest
    elif (path / "manifest.json").is_file() and (problem := verify_checkpoint(path)) is not None:
        raise ValueError(f"sft.init_from {path} is damaged: {problem}")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tiktoken.model")):
        raise ValueError(f"checkpoint {path} has no tokenizer (tokenizer.json or tiktoken.model)")
    return path


def sft_run_config(cfg: RunConfig) -> tuple[RunConfig, Path]:
    """`cfg` with the model config and tokenizer of the init checkpoint (the [model] table does not apply)."""
    if cfg.sft is None:
        raise ValueError("the config has no [sft] table (see configs/sft-tiny.toml)")
    init = resolve_init_checkpoint(cfg.sft.init_from)
    cfg = dataclasses.replace(cfg, model=ModelConfig.from_hf(init),
                              tokenizer=dataclasses.replace(cfg.tokenizer, path=str(init)))
    return cfg, init


class SFTTrainer(Trainer):
    """The pre-training loop on packed conversations, starting from `init_checkpoint`'s weights."""

    progress_label = "sft"

    def __init__(self, cfg: RunConfig, init_checkpoint: Path, out_dir: str | Path | None = None,
                 resume: bool = False) -> None:
        self.sft: SFTSection = cfg.sft
        self.init_checkpoint = Path(init_checkpoint)
        super().__init__(cfg, out_dir=out_dir, resume=resume)
        self.flops_per_token = training_flops_per_token(cfg.model, self.sft.seq_len)

    def _build_model(self) -> K2ForCausalLM:
        # A resumed run then loads its own checkpoint over these weights.
        return K2ForCausalLM.from_pretrained(self.init_checkpoint, dtype=torch.float32)

    def _build_train_loader(self) -> ConversationLoader:
        train, val = self._conversations()
        tok, seq_len = self.tokenizer, self.sft.seq_len
        self.train_data = tokenize_conversations(train, tok, seq_len, self.sft.overlong)
        self.val_data = tokenize_conversations(val, tok, seq_len, self.sft.overlong)
        for name, data in (("train", self.train_data), ("val", self.val_data)):
            print(f"sft {name}: {len(data)} conversations, {len(data.tokens):,} tokens "
                  f"({data.mask.mean():.0%} assistant), {data.truncated} truncated, {data.skipped} skipped "
                  f"(seq_len {seq_len})", file=sys.stderr)
        return ConversationLoader(self.train_data, self.cfg.train.batch_size, seq_len, tok.pad_id,
                                  seed=self.cfg.train.seed)

    def _conversations(self) -> tuple[list[dict], list[dict]]:
        sft = self.sft
        train = [c for path in sft.train_files for c in read_conversations(path)]
        if sft.generate:
            generated = toolchat.generate(sft.generate, sft.generate_seed, sft.plain_fraction)
            write_conversations(self.out_dir / GENERATED_FILE, generated)  # what the run learned from, to inspect
            train += generated
        if sft.val_files:
            return train, [c for path in sft.val_files for c in read_conversations(path)]
        return split_conversations(train, sft.val_fraction, seed=sft.generate_seed)

    def _val_loader(self) -> ConversationLoader:
        return ConversationLoader(self.val_data, self.cfg.train.batch_size, self.sft.seq_len, self.tokenizer.pad_id,
                                  shuffle=False, loop=False)

    def _unigram_baseline(self) -> float:
        data: TokenizedConversations = self.train_data
        return unigram_baseline(data.targets(), self.val_data.targets(), vocab_size=self.tokenizer.vocab_size)

    def _forward(self, batch: dict[str, torch.Tensor]):
        return self.model(batch["input_ids"].to(self.device), labels=batch["labels"].to(self.device),
                          position_ids=batch["position_ids"].to(self.device),
                          segment_ids=batch["segment_ids"].to(self.device))

    def score_tool_calls(self, model: K2ForCausalLM | None = None) -> ToolCallScore | None:
        """The well-formed tool-call rate of `model` (default: the one being trained) on held-out prompts."""
        if not self.sft.eval_prompts:
            return None
        prompts = toolchat.heldout_prompts(self.sft.eval_prompts, self.sft.eval_seed)
        return evaluate_tool_calls(model or self.model, self.tokenizer, prompts, self.sft.eval_max_tokens)


def _write_json(path: Path, record: dict) -> None:
    atomic_write_text(path, json.dumps(record, indent=2))


def sft_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="openk2 sft",
        description="Fine-tune a checkpoint on chat/tool-use conversations (loss on assistant tokens, MuonClip), "
                    "and report the well-formed K2 tool-call rate on held-out prompts before and after.")
    parser.add_argument("--config", required=True, help="TOML run config with an [sft] table (configs/sft-tiny.toml)")
    parser.add_argument("--out", help="run directory (default: out_dir from the config)")
    parser.add_argument("--init-from", help="checkpoint or pre-training run directory (overrides sft.init_from)")
    parser.add_argument("--max-steps", type=int, help="stop after this step without changing the schedule")
    parser.add_argument("--resume", action="store_true", help="continue from the run's newest complete checkpoint")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, e.g. --set sft.generate=500 (repeatable)")
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
            _write_json(eval_path, record)
            print(f"tool calls before SFT: {before.summary()}", file=sys.stderr)
    try:
        summary = trainer.run(max_steps=args.max_steps)
    except BadStepError as err:
        print(f"openk2 sft: {err}", file=sys.stderr)
        return 1
    after = trainer.score_tool_calls()
    if after is not None:
        record.update(after=after.as_dict(), after_step=summary.step)
        _write_json(eval_path, record)

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
