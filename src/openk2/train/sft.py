"""Supervised fine-tuning (K2 report, section 3.1): continue a pre-trained checkpoint with MuonClip on chat and
tool-use conversations, loss on assistant tokens only, conversations packed but attending only to themselves.

The loop is the pre-training Trainer's (schedule, MuonClip, bad-step handling, metrics, plots, atomic and
resumable checkpoints); `SFTTrainer` only swaps what it is built from: the initial weights and tokenizer come
from `sft.init_from`, batches from a ConversationLoader, and the forward pass takes segment and position ids.
The training stream mixes the conversations (files, procedural tool chat, synthesized trajectories) with a
share `sft.pretrain_fraction` of pre-training rows (`openk2.train.sft_mixture`). Around the run, `openk2 sft`
measures the rate of well-formed K2 tool calls on held-out prompts (procedural and synthesized) and the
corpus perplexity before and after, and writes them to `toolcall_eval.json` in the run directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

from openk2.config import ModelConfig
from openk2.data import toolchat
from openk2.data.conversations import (
    ConversationLoader,
    TokenizedConversations,
    read_conversations,
    split_conversations,
    tokenize_conversations,
    write_conversations,
)
from openk2.data.unigram import unigram_baseline
from openk2.fileio import atomic_write_text
from openk2.model import ForwardStats, K2ForCausalLM
from openk2.train.checkpoint import CheckpointManager, verify_checkpoint
from openk2.train.config import RunConfig, SFTSection
from openk2.train.flops import training_flops_per_token
from openk2.train.sft_mixture import MixedLoader, SynthData, pretrain_loader, read_synthesized, tool_call_prompts
from openk2.train.toolcall_eval import ToolCallScore, evaluate_tool_calls
from openk2.train.trainer import Trainer

EVAL_FILE = "toolcall_eval.json"
GENERATED_FILE = "toolchat_train.jsonl"


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

    def _build_train_loader(self) -> MixedLoader:
        train, val = self._conversations()
        tok, seq_len = self.tokenizer, self.sft.seq_len
        self.train_data = tokenize_conversations(train, tok, seq_len, self.sft.overlong)
        self.val_data = tokenize_conversations(val, tok, seq_len, self.sft.overlong)
        for name, data in (("train", self.train_data), ("val", self.val_data)):
            print(f"sft {name}: {len(data)} conversations, {len(data.tokens):,} tokens "
                  f"({data.mask.mean():.0%} assistant), {data.truncated} truncated, {data.skipped} skipped "
                  f"(seq_len {seq_len})", file=sys.stderr)
        conversations = ConversationLoader(self.train_data, self.cfg.train.batch_size, seq_len, tok.pad_id,
                                           seed=self.cfg.train.seed)
        fraction = self.sft.pretrain_fraction
        corpus = pretrain_loader(self.cfg.data, tok, seq_len) if fraction > 0 else None
        if corpus is not None:
            print(f"sft mixture: {fraction:.1%} of rows are pre-training text ({len(self.cfg.data.sources)} "
                  f"[data] sources, train split, loss on all tokens)", file=sys.stderr)
        return MixedLoader(conversations, corpus, fraction, self.cfg.train.batch_size)

    def _conversations(self) -> tuple[list[dict], list[dict]]:
        sft = self.sft
        train = [c for path in sft.train_files for c in read_conversations(path)]
        if sft.generate:
            generated = toolchat.generate(sft.generate, sft.generate_seed, sft.plain_fraction, sft.novel_fraction)
            write_conversations(self.out_dir / GENERATED_FILE, generated)  # what the run learned from, to inspect
            train += generated
        self.synth = SynthData()
        if sft.synth_files:
            self.synth = read_synthesized(sft.synth_files, sft.synth_heldout, seed=sft.eval_seed)
            print(f"sft synthesized data: {self.synth.summary()}", file=sys.stderr)
            if not self.synth.train:
                print("sft: warning: the synthesized data holds no training trajectory", file=sys.stderr)
            train += self.synth.train
        if not train:
            raise ValueError("sft has no training conversations (the synthesized data is empty and nothing else "
                             "is configured)")
        if sft.val_files:
            return train, [c for path in sft.val_files for c in read_conversations(path)]
        return split_conversations(train, sft.val_fraction, seed=sft.generate_seed)

    def _bad_loss(self, loss: float) -> str | None:
        # A step whose batches hold pre-training rows has a higher mean loss by construction (every corpus token
        # is a target, at pre-training loss, and outnumbers the assistant tokens), so comparing it with the
        # running mean would skip exactly those steps; there only a non-finite loss is bad.
        loader: MixedLoader = self.train_loader
        rows_this_step = self.cfg.train.batch_size * self.cfg.train.grad_accum
        if loader.pretrain_rows() > math.floor((loader.rows - rows_this_step) * loader.fraction):
            return None if math.isfinite(loss) else f"non-finite loss ({loss})"
        return super()._bad_loss(loss)

    def _val_loader(self) -> ConversationLoader:
        return ConversationLoader(self.val_data, self.cfg.train.batch_size, self.sft.seq_len, self.tokenizer.pad_id,
                                  shuffle=False, loop=False)

    def _unigram_baseline(self) -> float:
        data: TokenizedConversations = self.train_data
        return unigram_baseline(data.targets(), self.val_data.targets(), vocab_size=self.tokenizer.vocab_size)

    def _forward(self, batch: dict[str, torch.Tensor], stats: ForwardStats | None = None):
        return self.model(batch["input_ids"].to(self.device), labels=batch["labels"].to(self.device),
                          position_ids=batch["position_ids"].to(self.device),
                          segment_ids=batch["segment_ids"].to(self.device), stats=stats)

    def score_tool_calls(self, model: K2ForCausalLM | None = None) -> ToolCallScore | None:
        """The well-formed tool-call rate of `model` (default: the one being trained) on held-out prompts."""
        if not self.sft.eval_prompts:
            return None
        prompts = toolchat.heldout_prompts(self.sft.eval_prompts, self.sft.eval_seed)
        return evaluate_tool_calls(model or self.model, self.tokenizer, prompts, self.sft.eval_max_tokens)

    def score_synth_tool_calls(self, model: K2ForCausalLM | None = None) -> ToolCallScore | None:
        """The same scores on the held-out synthesized tasks (None when there are none)."""
        prompts = tool_call_prompts(self.synth.heldout)[:self.sft.synth_eval_prompts]
        if not prompts:
            return None
        return evaluate_tool_calls(model or self.model, self.tokenizer, prompts, self.sft.eval_max_tokens)

    def mixture_counts(self) -> dict:
        """Rows and labelled tokens the run has trained on so far, per kind (conversations, pre-training)."""
        loader: MixedLoader = self.train_loader
        labels = loader.labels
        total = max(sum(labels.values()), 1)
        return {"pretrain_fraction": loader.fraction, "rows": loader.rows, "pretrain_rows": loader.pretrain_rows(),
                "labelled_tokens": dict(labels), "pretrain_label_share": labels["pretrain"] / total}


def write_json(path: Path, record: dict) -> None:
    atomic_write_text(path, json.dumps(record, indent=2))
