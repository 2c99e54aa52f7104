"""The pipeline's TOML schema: one table per stage, each pointing at the stage's own run file and overriding it.

    out_dir = "runs/pipeline-tiny"
    threads = 0                      # torch threads for every stage (0: each stage file's own); --threads overrides

    [tokenizer]                      # BPE trained on the pre-training mixture; its size becomes model.vocab_size
    vocab_size = 2048
    train_chars = 1000000

    [pretrain]
    config = "tiny.toml"             # a pre-training run file, relative to this file
    [pretrain.set]                   # overrides, exactly what `openk2 pretrain --set` takes
    train.steps = 300

    [sft]
    config = "sft-tiny.toml"
    task_examples = 1500             # worked solutions of the RL task added to the SFT conversations
    [sft.set]
    train.steps = 60

    [rl]
    config = "rl-tiny.toml"          # its [model] table is replaced by the SFT checkpoint
    [rl.set]
    train.iterations = 30

    [eval]
    benchmarks = ["rl:arithmetic", "perplexity"]
    after = ["pretrain", "sft", "rl"]
    limit = 20

The pipeline owns a few keys of every stage (run directories, the tokenizer, the init checkpoint, threads);
setting one of them in a `set` table is an error. Unknown keys are errors, as in every run file here.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openk2.configfile import (
    ConfigError,
    build_section,
    check_keys,
    check_type,
    config_errors,
    load_config,
    merge_tables,
    read_toml,
)

TRAINING_STAGES = ("pretrain", "sft", "rl")

# Keys of each stage's run file that the pipeline sets itself (dotted paths into the stage's raw config).
OWNED_KEYS: dict[str, tuple[str, ...]] = {
    "pretrain": ("out_dir", "tokenizer.path", "model.vocab_size"),
    "sft": ("out_dir", "sft.init_from"),
    "rl": ("out_dir", "model"),
}


@dataclass(kw_only=True)
class TokenizerStageConfig:
    vocab_size: int = 2048  # total ids, K2's 256-slot special block included
    train_chars: int = 1_000_000  # characters of the pre-training mixture the BPE is fitted on

    def __post_init__(self) -> None:
        if self.vocab_size <= 512 or self.train_chars < 1:
            raise ValueError("tokenizer.vocab_size must exceed 512 (bytes + special block) and train_chars be >= 1")


@dataclass(kw_only=True)
class TrainStageConfig:
    """A training stage: its run file and the overrides applied on top of it."""

    config: str  # path of the stage's run file (resolved against the pipeline file's directory)
    set: dict[str, Any] = field(default_factory=dict)  # nested table of overrides, as `--set a.b=v` would give


@dataclass(kw_only=True)
class SFTStageConfig(TrainStageConfig):
    # Worked solutions of the RL task (the RL warm-up's generator) added to the SFT conversations, so that RL
    # starts from a policy that can already write the task's answer format (K2 starts RL from its SFT model).
    task_examples: int = 0

    def __post_init__(self) -> None:
        if self.task_examples < 0:
            raise ValueError(f"sft.task_examples must be >= 0, got {self.task_examples}")


@dataclass(kw_only=True)
class EvalStageConfig:
    benchmarks: list[str] = field(default_factory=lambda: ["rl:arithmetic"])  # openk2.eval.registry names
    after: list[str] = field(default_factory=lambda: list(TRAINING_STAGES))  # evaluate each of these checkpoints
    limit: int = 20  # samples per benchmark (the first `limit`); 0: all of them
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    concurrency: int = 1

    def __post_init__(self) -> None:
        if not self.benchmarks:
            raise ValueError("eval.benchmarks must name at least one benchmark")
        unknown = [s for s in self.after if s not in TRAINING_STAGES]
        if unknown or len(set(self.after)) != len(self.after):
            raise ValueError(f"eval.after must list distinct stages among {TRAINING_STAGES}, got {self.after}")
        if self.limit < 0:
            raise ValueError(f"eval.limit must be >= 0 (0: every sample), got {self.limit}")
        if self.max_tokens < 1 or self.concurrency < 1:
            raise ValueError("eval.max_tokens and eval.concurrency must be >= 1")


@dataclass(kw_only=True)
class PipelineConfig:
    tokenizer: TokenizerStageConfig
    pretrain: TrainStageConfig
    sft: SFTStageConfig
    rl: TrainStageConfig
    eval: EvalStageConfig
    out_dir: str = "runs/pipeline"
    threads: int = 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any], root: str | Path = ".") -> PipelineConfig:
        """Build from a parsed pipeline file; stage `config` paths are resolved against `root`."""
        raw = dict(raw)
        known = {"out_dir", "threads", "tokenizer", "pretrain", "sft", "rl", "eval"}
        check_keys(raw, known, "unknown pipeline key(s)")
        missing = [s for s in TRAINING_STAGES if s not in raw]
        if missing:
            raise ValueError(f"the pipeline config needs a table for every training stage; missing: {missing}")
        stages = {}
        for name, cls_ in (("pretrain", TrainStageConfig), ("sft", SFTStageConfig), ("rl", TrainStageConfig)):
            table = raw[name]
            if not isinstance(table, dict) or "config" not in table:
                raise ValueError(f"[{name}] needs `config = \"<run file>\"`")
            stage = build_section(cls_, name, table)
            stage.config = str(_resolve(root, stage.config, name))
            _check_owned(name, stage.set)
            stages[name] = stage
        threads = raw.get("threads", 0)
        check_type(threads, int, "threads")
        check_type(raw.get("out_dir", ""), str, "out_dir")
        if threads < 0:
            raise ConfigError(f"threads must be an integer >= 0, got {threads!r}", "threads")
        return cls(tokenizer=build_section(TokenizerStageConfig, "tokenizer", raw.get("tokenizer", {})),
                   eval=build_section(EvalStageConfig, "eval", raw.get("eval", {})),
                   out_dir=str(raw.get("out_dir", "runs/pipeline")), threads=threads, **stages)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def stage_raw(self, name: str) -> dict[str, Any]:
        """The stage's run file (its `base` chain resolved) with the stage's `set` table merged over it."""
        stage: TrainStageConfig = getattr(self, name)
        return merge_tables(read_toml(stage.config), copy.deepcopy(stage.set))

    def stage_errors(self, name: str) -> AbstractContextManager[None]:
        """A context in which a bad key of the stage's config is reported with the file or `set` it came from."""
        stage: TrainStageConfig = getattr(self, name)
        return config_errors(stage.config, layers=[(f"the pipeline's [{name}.set]", stage.set)])


def _resolve(root: str | Path, path: str, stage: str) -> Path:
    resolved = (Path(root) / path).resolve()
    if not resolved.is_file():
        raise ValueError(f"[{stage}] config {path!r} not found (looked for {resolved})")
    return resolved


def _check_owned(stage: str, overrides: dict[str, Any]) -> None:
    if not isinstance(overrides, dict):
        raise ValueError(f"[{stage}.set] must be a table of overrides")
    for dotted in OWNED_KEYS[stage]:
        node: Any = overrides
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            raise ValueError(f"[{stage}.set] may not set {dotted}: the pipeline sets it")


def load_pipeline_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a pipeline TOML file (`base = "..."` inherits) and apply `section.key=value` overrides; a bad key or
    value is a ValueError naming it and its file or `--set`."""
    return load_config(path, overrides, lambda raw: PipelineConfig.from_dict(raw, root=Path(path).resolve().parent))


__all__ = ["EvalStageConfig", "PipelineConfig", "SFTStageConfig", "TokenizerStageConfig", "TrainStageConfig",
           "load_pipeline_config"]
