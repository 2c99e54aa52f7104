"""Run configuration: one TOML file, one section per component, `--set section.key=value` overrides.

Each section maps onto one dataclass; an unknown key anywhere is a ValueError naming it.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openk2.config import ModelConfig
from openk2.data.corpus import CorpusConfig
from openk2.optim.schedule import WSDConfig
from openk2.train.memory import MemorySection
from openk2.train.parallel.config import ParallelConfig

PRECISIONS = ("auto", "fp32", "bf16")
BAD_STEP_POLICIES = ("skip", "stop")


def build_section(cls, section: str, values: Any):
    """`cls(**values)` for the TOML table `[section]`, with one clear error for a non-table or an unknown key."""
    if not isinstance(values, dict):
        raise ValueError(f"[{section}] must be a table")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown key(s) in [{section}]: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return cls(**values)


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
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    rms_scale: float = 0.2  # update RMS matched to AdamW: 0.2 * sqrt(max(n, m))
    ns_dtype: str = "bfloat16"
    grad_clip: float = 1.0  # global grad-norm clip; <= 0 turns it off
    bias_update_rate: float | None = None  # aux-loss-free balancing rate; None: the model config's

    def muonclip_kwargs(self) -> dict[str, Any]:
        """The keywords `MuonClip` and the parallel trainer's `ZeroMuonClip` both take, read from this table
        (one mapping, so a new optimizer option reaches both)."""
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
    spike_factor: float = 3.0  # a loss above this times its running mean is a spike (after warm-up)
    on_bad_step: str = "skip"  # what a NaN/inf or spiking loss does: skip the update, or stop the run
    tensorboard: bool = False
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.on_bad_step not in BAD_STEP_POLICIES:
            raise ValueError(f"train.on_bad_step must be one of {BAD_STEP_POLICIES}, got {self.on_bad_step!r}")
        for name in ("steps", "batch_size", "grad_accum", "log_every", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be at least 1, got {getattr(self, name)}")


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
    sft: Any = None  # openk2.train.sft.SFTSection: the [sft] table of `openk2 sft` runs
    out_dir: str = "runs/tiny"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        raw = dict(raw)
        sections = {"model", "tokenizer", "data", "optim", "schedule", "train", "parallel", "memory", "sft", "out_dir"}
        unknown = sorted(set(raw) - sections)
        if unknown:
            raise ValueError(f"unknown section(s): {', '.join(unknown)} (known: {', '.join(sorted(sections))})")
        model = dict(raw.get("model", {}))
        preset = model.pop("preset", "tiny")
        return cls(
            model=ModelConfig.preset(preset).replace(**model) if model else ModelConfig.preset(preset),
            tokenizer=build_section(TokenizerSection, "tokenizer", raw.get("tokenizer", {})),
            data=CorpusConfig.from_dict(raw.get("data", {})),
            optim=build_section(OptimSection, "optim", raw.get("optim", {})),
            schedule=build_section(ScheduleSection, "schedule", raw.get("schedule", {})),
            train=build_section(TrainSection, "train", raw.get("train", {})),
            parallel=build_section(ParallelConfig, "parallel", raw.get("parallel", {})),
            memory=build_section(MemorySection, "memory", raw.get("memory", {})),
            sft=_sft_section(raw["sft"]) if "sft" in raw else None,
            out_dir=raw.get("out_dir", "runs/tiny"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": dataclasses.asdict(self.model), "tokenizer": dataclasses.asdict(self.tokenizer),
            "data": self.data.to_dict(), "optim": dataclasses.asdict(self.optim),
            "schedule": dataclasses.asdict(self.schedule), "train": dataclasses.asdict(self.train),
            "parallel": dataclasses.asdict(self.parallel), "memory": dataclasses.asdict(self.memory),
            **({"sft": dataclasses.asdict(self.sft)} if self.sft is not None else {}),
            "out_dir": self.out_dir,
        }


def _sft_section(values: dict[str, Any]):
    from openk2.train.sft import SFTSection  # imported here: sft.py builds on the trainer, which imports this

    return build_section(SFTSection, "sft", values)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare string


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings (values parsed as TOML, else taken as strings)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects section.key=value, got {item!r}")
        dotted, value = item.split("=", 1)
        *path, key = dotted.strip().split(".")
        node = raw
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {dotted}: {part} is not a section")
        node[key] = _parse_value(value.strip())
    return raw


def merge_tables(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` with `override` on top, sub-tables merged key by key (a config file over the one it inherits)."""
    out = dict(base)
    for key, value in override.items():
        both_tables = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merge_tables(out[key], value) if both_tables else value
    return out


def read_toml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a TOML run file; `base = "other.toml"` (relative to it) is read first and overridden key by key."""
    path = Path(path).resolve()
    if path in _seen:
        raise ValueError(f"config inheritance loops through {path}")
    if not path.is_file():
        raise ValueError(f"config file {path} not found")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path} is not valid TOML: {err}") from None
    base = raw.pop("base", None)
    return merge_tables(read_toml(path.parent / base, (*_seen, path)), raw) if base else raw


def load_run_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML run config (or the defaults when `path` is None) and apply overrides."""
    raw = read_toml(path) if path is not None else {}
    return RunConfig.from_dict(apply_overrides(raw, overrides or []))
