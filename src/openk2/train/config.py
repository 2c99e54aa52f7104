"""Run configuration of `openk2 pretrain` and `openk2 sft`: one TOML file, one section per component.

Each section maps onto one dataclass, read by `openk2.configfile` (`base =` inheritance, `--set section.key=value`
overrides); an unknown key or a value of the wrong type anywhere is a ValueError naming it and its file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openk2.config import ModelConfig
from openk2.configfile import (
    ConfigError,
    build_named_tables,
    build_section,
    check_keys,
    check_table,
    check_type,
    load_config,
    table_errors,
)
from openk2.data.conversations import OVERLONG_POLICIES
from openk2.data.corpus import CorpusConfig
from openk2.optim.schedule import WSDConfig
from openk2.train.memory import MemorySection
from openk2.train.parallel.config import ParallelConfig

PRECISIONS = ("auto", "fp32", "bf16")
BAD_STEP_POLICIES = ("skip", "stop")
ROPE_MODES = ("model", "plain", "yarn")


@dataclass(kw_only=True)
class TokenizerSection:
    path: str | None = None  # a saved tokenizer (dir or tokenizer.json); default: train one into the run dir
    train_chars: int = 4_000_000  # characters of the corpus mixture the tokenizer is trained on


@dataclass(kw_only=True)
class OptimSection:
    optimizer: str = "muon"  # "muon": MuonClip (Muon + AdamW + QK-Clip); "adamw": AdamW for every parameter
    lr: float = 2e-3  # peak learning rate (shared by Muon and AdamW, as in the report)
    weight_decay: float = 0.1
    qk_clip_tau: float = 100.0  # <= 0 turns QK-Clip off (vanilla Muon); max logits are still logged
    max_logit_every: int = 1  # with QK-Clip off: run the max-logit probe every N steps (0: never); on: every step
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    rms_scale: float = 0.2  # update RMS matched to AdamW: 0.2 * sqrt(max(n, m))
    ns_dtype: str = "bfloat16"
    grad_clip: float = 1.0  # global grad-norm clip; <= 0 turns it off
    bias_update_rate: float | None = None  # aux-loss-free balancing rate; None: the model config's

    def muonclip_kwargs(self) -> dict[str, Any]:
        """The keywords `MuonClip` and the parallel trainer's `DistributedMuonClip` both take, read from this
        table (one mapping, so a new optimizer option reaches both)."""
        import torch

        return {"lr": self.lr, "weight_decay": self.weight_decay,
                "tau": self.qk_clip_tau if self.qk_clip_tau > 0 else None, "momentum": self.momentum,
                "nesterov": self.nesterov, "ns_steps": self.ns_steps, "rms_scale": self.rms_scale,
                "ns_dtype": getattr(torch, self.ns_dtype), "use_muon": self.optimizer == "muon"}

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be positive, got {self.lr}")
        if self.optimizer not in ("muon", "adamw"):
            raise ValueError(f"optim.optimizer must be muon or adamw, got {self.optimizer!r}")
        if self.max_logit_every < 0:
            raise ValueError(f"optim.max_logit_every must be >= 0 (0: never probe), got {self.max_logit_every}")
        if self.ns_dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"optim.ns_dtype must be bfloat16, float16 or float32, got {self.ns_dtype!r}")


@dataclass(kw_only=True)
class ScheduleSection:
    """WSD over `train.steps`: warm-up, constant, cosine decay over the last `decay_fraction`, optional anneal."""

    warmup_steps: int = 50
    decay_fraction: float = 0.3
    decay_steps: int | None = None  # exact decay length; overrides decay_fraction
    final_lr_ratio: float = 0.1  # decay floor / peak (K2: 2e-5 / 2e-4)
    anneal_steps: int = 0  # extra steps after the decay, linear to anneal_lr_ratio * peak (K2: 7e-6 / 2e-4)
    anneal_lr_ratio: float = 0.035

    def __post_init__(self) -> None:
        if not 0 <= self.decay_fraction <= 1:
            raise ValueError(f"schedule.decay_fraction must lie in [0, 1], got {self.decay_fraction}")

    def build(self, steps: int, peak_lr: float) -> WSDConfig:
        main = steps - self.anneal_steps
        decay = self.decay_steps if self.decay_steps is not None else round(main * self.decay_fraction)
        stable = main - decay - self.warmup_steps
        if stable < 0:
            raise ValueError(f"train.steps={steps} is too short for {self.warmup_steps} warm-up, {decay} decay and "
                             f"{self.anneal_steps} anneal steps")
        return WSDConfig(
            peak_lr=peak_lr, warmup_steps=self.warmup_steps, stable_steps=stable, decay_steps=decay,
            decay_floor=peak_lr * self.final_lr_ratio, anneal_steps=self.anneal_steps,
            anneal_floor=peak_lr * self.anneal_lr_ratio if self.anneal_steps else None,
        )


@dataclass(kw_only=True)
class TrainSection:
    steps: int = 600  # length of the schedule; --max-steps stops earlier without changing it
    batch_size: int = 16  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    precision: str = "auto"  # auto: bf16 autocast where bf16 matmuls are fast (CUDA, AMX CPUs), else fp32
    device: str = "auto"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    async_checkpoint: bool = False  # write the DCP shards in a background thread (committed at the next save)
    spike_factor: float = 3.0  # a loss above this times its running mean is a spike (after warm-up)
    on_bad_step: str = "skip"  # what a NaN/inf or spiking loss does: skip the update, or stop the run
    tensorboard: bool = False
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    compile: bool = False  # torch.compile each decoder block (model/compile.py); measured in docs/benchmarks.md
    loss_chunk_tokens: int = 0  # > 0: the loss over the vocabulary this many tokens at a time (no [N, V] logits)

    def __post_init__(self) -> None:
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"train.loss_chunk_tokens must be >= 0, got {self.loss_chunk_tokens}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.on_bad_step not in BAD_STEP_POLICIES:
            raise ValueError(f"train.on_bad_step must be one of {BAD_STEP_POLICIES}, got {self.on_bad_step!r}")
        for name in ("steps", "batch_size", "grad_accum", "log_every", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be at least 1, got {getattr(self, name)}")


@dataclass(kw_only=True)
class StageSection:
    """One `[[stages]]` entry: a segment of the run with its own length, RoPE, batch, data mixture and learning
    rate (openk2.train.stages resolves and applies it; without `[[stages]]` the run is one stage)."""

    name: str
    steps: int  # optimizer steps in this stage; 0: a stage that only sets the final model's RoPE and length
    seq_len: int | None = None  # default: data.seq_len
    batch_size: int | None = None  # default: train.batch_size
    grad_accum: int | None = None  # default: train.grad_accum
    rope: str = "model"  # "model": [model].rope_scaling as is; "plain": no scaling; "yarn": YaRN (see `yarn`)
    yarn: dict[str, Any] = field(default_factory=dict)  # rope_scaling keys over [model]'s yarn (factor, ...)
    max_position_embeddings: int | None = None  # default: [model]'s
    lr_ratio: float | None = None  # None: [schedule] at the global step; else lr = lr_ratio x optim.lr ...
    lr_ratio_end: float | None = None  # ... moving linearly to lr_ratio_end x optim.lr (default: constant)
    qk_clip_tau: float | None = None  # default: optim.qk_clip_tau x (this stage's softmax scale / the first's)
    sources: list[dict[str, Any]] | None = None  # default: data.sources (the same stream continues)

    def __post_init__(self) -> None:
        where = f"stage {self.name!r}"
        if not self.name:
            raise ValueError("every stage needs a non-empty name")
        if self.steps < 0:
            raise ValueError(f"{where}: steps must be >= 0, got {self.steps}")
        if self.rope not in ROPE_MODES:
            raise ValueError(f"{where}: rope must be one of {ROPE_MODES}, got {self.rope!r}")
        if self.yarn and self.rope != "yarn":
            raise ValueError(f"{where}: yarn settings need rope = \"yarn\" (got rope = {self.rope!r})")
        for name in ("seq_len", "batch_size", "grad_accum", "max_position_embeddings"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{where}: {name} must be at least 1, got {value}")
        if self.lr_ratio_end is not None and self.lr_ratio is None:
            raise ValueError(f"{where}: lr_ratio_end needs lr_ratio")
        for name in ("lr_ratio", "lr_ratio_end"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{where}: {name} must be >= 0, got {value}")
        if self.qk_clip_tau is not None and self.qk_clip_tau <= 0:
            raise ValueError(f"{where}: qk_clip_tau must be positive (turn QK-Clip off in [optim]), "
                             f"got {self.qk_clip_tau}")


@dataclass(kw_only=True)
class SFTSection:
    """The [sft] table of `openk2 sft` runs: where the model starts, which conversations it learns, how tool
    calls are scored."""

    init_from: str | None = None  # a checkpoint dir, or a run dir (its newest complete checkpoint); required
    train_files: list[str] = field(default_factory=list)  # conversation JSONL files
    val_files: list[str] = field(default_factory=list)  # default: val_fraction of the training conversations
    generate: int = 0  # add this many openk2.data.toolchat conversations to the training data
    generate_seed: int = 0
    plain_fraction: float = 0.2  # share of generated conversations that are plain chat (no tool needed)
    novel_fraction: float = 0.0  # share of generated tool conversations with made-up entities (copy, not recall)
    val_fraction: float = 0.05
    seq_len: int = 512  # tokens per packed row
    overlong: str = "truncate"  # a conversation longer than seq_len: "truncate" it or "skip" it
    eval_prompts: int = 48  # held-out toolchat prompts for the tool-call rate before/after; 0 turns it off
    eval_seed: int = 0
    eval_max_tokens: int = 64
    synth_files: list[str] = field(default_factory=list)  # `openk2 synth run` output dirs (their sft.jsonl) or files
    synth_heldout: float = 0.1  # share of synthesized tasks (by task id) held out to score tool calls
    synth_eval_prompts: int = 48  # at most this many held-out synthesized prompts scored before/after
    pretrain_fraction: float = 0.0  # share of training rows that are [data] corpus text (loss on all tokens)
    perplexity_windows: int = 64  # [data] validation windows whose perplexity is measured before/after; 0: off

    def __post_init__(self) -> None:
        if not 0 <= self.pretrain_fraction < 1:
            raise ValueError(f"sft.pretrain_fraction must lie in [0, 1), got {self.pretrain_fraction}")
        if not 0 <= self.synth_heldout < 1:
            raise ValueError(f"sft.synth_heldout must lie in [0, 1), got {self.synth_heldout}")
        if self.synth_eval_prompts < 0 or self.perplexity_windows < 0:
            raise ValueError("sft.synth_eval_prompts and sft.perplexity_windows must be non-negative")
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"sft.overlong must be one of {OVERLONG_POLICIES}, got {self.overlong!r}")
        if self.seq_len < 2:
            raise ValueError(f"sft.seq_len must be at least 2, got {self.seq_len}")
        if self.generate < 0 or self.eval_prompts < 0:
            raise ValueError("sft.generate and sft.eval_prompts must be non-negative")
        if not self.train_files and self.generate == 0 and not self.synth_files:
            raise ValueError("sft needs training data: set sft.train_files, sft.generate and/or sft.synth_files")


@dataclass(kw_only=True)
class RunConfig:
    model: ModelConfig
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: CorpusConfig = field(default_factory=CorpusConfig)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # torchrun layout: pp x dp x ep ranks
    memory: MemorySection = field(default_factory=MemorySection)  # recompute / FP8 activations / CPU offload
    sft: SFTSection | None = None  # the [sft] table of `openk2 sft` runs
    stages: list[StageSection] = field(default_factory=list)  # [[stages]]: none = one stage, the run as a whole
    out_dir: str = "runs/tiny"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        raw = dict(raw)
        sections = {"model", "tokenizer", "data", "optim", "schedule", "train", "parallel", "memory", "sft", "stages",
                    "out_dir"}
        check_keys(raw, sections, "unknown section(s)")
        check_table(ModelConfig, "model", raw.get("model", {}), extra={"preset": str})
        model = dict(raw.get("model", {}))
        preset = model.pop("preset", "tiny")
        with table_errors("model"):
            model_cfg = ModelConfig.preset(preset).replace(**model) if model else ModelConfig.preset(preset)
        check_table(CorpusConfig, "data", raw.get("data", {}))
        with table_errors("data"):
            data = CorpusConfig.from_dict(raw.get("data", {}))
        check_type(raw.get("out_dir", ""), str, "out_dir")
        stages = _build_stages(raw)
        train = build_section(TrainSection, "train", _stage_steps(raw, stages))
        return cls(
            model=model_cfg,
            tokenizer=build_section(TokenizerSection, "tokenizer", raw.get("tokenizer", {})),
            data=data,
            optim=build_section(OptimSection, "optim", raw.get("optim", {})),
            schedule=build_section(ScheduleSection, "schedule", raw.get("schedule", {})),
            train=train,
            parallel=build_section(ParallelConfig, "parallel", raw.get("parallel", {})),
            memory=build_section(MemorySection, "memory", raw.get("memory", {})),
            sft=build_section(SFTSection, "sft", raw["sft"]) if "sft" in raw else None,
            stages=stages,
            out_dir=raw.get("out_dir", "runs/tiny"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": dataclasses.asdict(self.model), "tokenizer": dataclasses.asdict(self.tokenizer),
            "data": self.data.to_dict(), "optim": dataclasses.asdict(self.optim),
            "schedule": dataclasses.asdict(self.schedule), "train": dataclasses.asdict(self.train),
            "parallel": dataclasses.asdict(self.parallel), "memory": dataclasses.asdict(self.memory),
            **({"sft": dataclasses.asdict(self.sft)} if self.sft is not None else {}),
            **({"stages": [dataclasses.asdict(s) for s in self.stages]} if self.stages else {}),
            "out_dir": self.out_dir,
        }


def _build_stages(raw: dict[str, Any]) -> list[StageSection]:
    built = build_named_tables(StageSection, "stages", raw.get("stages", []))
    if built and sum(s.steps for s in built) == 0:
        raise ConfigError("the stages have no steps to train", "stages")
    return built


def _stage_steps(raw: dict[str, Any], stages: list[StageSection]) -> dict[str, Any]:
    """The [train] table with steps = the stages' total (a different explicit train.steps is an error)."""
    train = dict(raw.get("train", {}))
    if not stages:
        return train
    total = sum(s.steps for s in stages)
    if "steps" in train and train["steps"] != total:
        raise ConfigError(f"train.steps = {train['steps']} but the stages add up to {total} steps; set "
                          f"train.steps = {total} or leave it out", "train.steps")
    train["steps"] = total
    return train


def load_run_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML run config (or the defaults when `path` is None; `base = "..."` inherits) and apply
    `section.key=value` overrides; a bad key or value is a ValueError naming it and its file or `--set`."""
    return load_config(path, overrides, RunConfig.from_dict)
