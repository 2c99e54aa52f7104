"""Training stages: the ordered segments of one pre-training run, each with its own sequence length, RoPE/YaRN,
batch, data mixture, learning-rate segment and QK-Clip threshold (K2: 4k with plain RoPE under WSD, annealing,
32k with YaRN switched on, the 128k window).

A `StagePlan` resolves the run config's `[[stages]]` (none: one stage that is the run as written) into `Stage`s
laid end to end over the global step count. Each stage carries the run config *as that stage sees it* (model
rope_scaling and max_position_embeddings, data seq_len and sources, batch size and accumulation replaced), so
every hook of the trainer that reads `cfg.data` or `cfg.train.batch_size` reads the stage's values.

Switching stage changes the live model in place (`apply_model_config`): the rotary tables and each attention's
softmax scale are recomputed from the new config; the weights are untouched. YaRN with `mscale_all_dim` (K2,
DeepSeek-V3) multiplies the softmax scale by mscale(factor)^2 (1.81 at factor 32), so every logit of the same
weights grows by that factor; QK-Clip's tau grows with it by default (it keeps bounding the same weights), or a
stage sets `qk_clip_tau` itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from openk2.config import ModelConfig
from openk2.data.corpus import CorpusConfig
from openk2.model import K2ForCausalLM
from openk2.model.attention import MLAttention
from openk2.model.rope import RotaryEmbedding, softmax_scale
from openk2.optim.schedule import WSDConfig, wsd_lr
from openk2.train.config import RunConfig, StageSection

# The only model fields a stage may change: the weights' shapes and meaning stay those of the first stage.
STAGE_MODEL_FIELDS = ("rope_scaling", "max_position_embeddings")
SINGLE_STAGE = "main"  # the name of the one stage of a run without [[stages]]


@dataclass(frozen=True)
class Stage:
    """One resolved stage: global steps (start, start + steps], the run config it trains with, its QK-Clip tau."""

    index: int
    name: str
    start: int  # global steps completed before this stage's first step
    steps: int
    cfg: RunConfig
    tau: float | None
    lr_ratio: float | None  # None: the run's [schedule]
    lr_ratio_end: float | None

    @property
    def end(self) -> int:
        return self.start + self.steps

    def describe(self, num_stages: int) -> str:
        """One line for the log: where the stage lies and what it trains with."""
        scaling = self.cfg.model.rope_scaling
        rope = "plain RoPE" if scaling is None or scaling.get("type") == "default" else (
            f"{scaling.get('type')} x{float(scaling['factor']):g} over {scaling['original_max_position_embeddings']}")
        tau = "off" if self.tau is None else f"{self.tau:.4g}"
        span = f"steps {self.start + 1}-{self.end}" if self.steps else "no steps (sets the final model)"
        return (f"stage {self.index + 1}/{num_stages} {self.name!r}: {span}, seq_len "
                f"{self.cfg.data.seq_len}, batch {self.cfg.train.batch_size}x{self.cfg.train.grad_accum}, {rope}, "
                f"softmax scale {softmax_scale(self.cfg.model):.4g}, QK-Clip tau {tau}")


def stage_model_config(model: ModelConfig, section: StageSection) -> ModelConfig:
    """[model] with the stage's RoPE (plain, as configured, or YaRN over the model's yarn keys) and length."""
    scaling = model.rope_scaling
    if section.rope == "plain":
        scaling = None
    elif section.rope == "yarn":
        base = dict(scaling or {}) if (scaling or {}).get("type", (scaling or {}).get("rope_type")) == "yarn" else {}
        base.pop("rope_type", None)
        scaling = {**base, **section.yarn, "type": "yarn"}
        for key in ("factor", "original_max_position_embeddings"):
            if key not in scaling:
                raise ValueError(f"stage {section.name!r}: rope = \"yarn\" needs yarn.{key} ([model] has no YaRN "
                                 "settings to take it from)")
    length = section.max_position_embeddings or model.max_position_embeddings
    try:
        return model.replace(rope_scaling=scaling, max_position_embeddings=length)
    except ValueError as err:
        raise ValueError(f"stage {section.name!r}: {err}") from None


def stage_run_config(cfg: RunConfig, section: StageSection) -> RunConfig:
    """The run config as `section` sees it (model RoPE, data, batch replaced; everything else the run's)."""
    data = cfg.data.to_dict()
    data["seq_len"] = section.seq_len or cfg.data.seq_len
    if section.sources is not None:
        data["sources"] = section.sources
    try:
        corpus = CorpusConfig.from_dict(data)
    except ValueError as err:
        raise ValueError(f"stage {section.name!r}: {err}") from None
    train = dataclasses.replace(cfg.train, batch_size=section.batch_size or cfg.train.batch_size,
                                grad_accum=section.grad_accum or cfg.train.grad_accum)
    return dataclasses.replace(cfg, model=stage_model_config(cfg.model, section), data=corpus, train=train)


class StagePlan:
    """The run's stages end to end; which one runs a step, its learning rate, and the [schedule] it follows."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        base_tau = cfg.optim.qk_clip_tau if cfg.optim.qk_clip_tau > 0 else None
        sections = cfg.stages or [StageSection(name=SINGLE_STAGE, steps=cfg.train.steps)]
        stages: list[Stage] = []
        start = 0
        for i, section in enumerate(sections):
            view = stage_run_config(cfg, section) if cfg.stages else cfg
            if section.qk_clip_tau is not None and base_tau is None:
                raise ValueError(f"stage {section.name!r} sets qk_clip_tau but QK-Clip is off (optim.qk_clip_tau <= 0)")
            tau = section.qk_clip_tau
            if tau is None and base_tau is not None:
                first = stages[0].cfg.model if stages else view.model
                tau = base_tau * softmax_scale(view.model) / softmax_scale(first)
            stages.append(Stage(index=i, name=section.name, start=start, steps=section.steps, cfg=view, tau=tau,
                                lr_ratio=section.lr_ratio, lr_ratio_end=section.lr_ratio_end))
            start += section.steps
        self.stages = stages
        self.total_steps = start
        self.schedule_steps = self._schedule_steps()

    def _schedule_steps(self) -> int:
        """Steps covered by [schedule]: the leading stages without lr_ratio (all steps when none follows it)."""
        covered, own = 0, None
        for stage in self.stages:
            if stage.lr_ratio is None:
                if own is not None and stage.steps:
                    raise ValueError(f"stage {stage.name!r} follows [schedule] but comes after stage {own!r}, which "
                                     "sets lr_ratio; [schedule] covers only the leading stages")
                covered = stage.end
            elif own is None:
                own = stage.name
        return covered or self.total_steps

    def build_schedule(self) -> WSDConfig:
        """The run's [schedule] over the steps of the stages that follow it."""
        return self.cfg.schedule.build(self.schedule_steps, self.cfg.optim.lr)

    def index_at(self, step: int) -> int:
        """The stage that runs step `step + 1` (`step` steps done); past the end, the last stage."""
        for stage in self.stages:
            if stage.start <= step < stage.end:
                return stage.index
        return self.stages[-1].index if step >= self.total_steps else 0

    def lr_at(self, step: int, schedule: WSDConfig) -> float:
        """Learning rate of step `step + 1`: the [schedule] or the stage's own linear segment."""
        stage = self.stages[self.index_at(step)]
        if stage.lr_ratio is None:
            return wsd_lr(step, schedule)
        end = stage.lr_ratio if stage.lr_ratio_end is None else stage.lr_ratio_end
        done = (step - stage.start) / max(stage.steps, 1)
        return self.cfg.optim.lr * (stage.lr_ratio + (end - stage.lr_ratio) * done)

    @property
    def explicit(self) -> bool:
        """Whether the run config has [[stages]] (metrics and checkpoints then name the stage)."""
        return bool(self.cfg.stages)


def apply_model_config(model: K2ForCausalLM, cfg: ModelConfig) -> None:
    """Switch a live model to `cfg`'s RoPE/YaRN and length in place: rotary tables and softmax scales are
    recomputed, weights untouched; any other difference from the model's config is a ValueError."""
    old, new = dataclasses.asdict(model.config), dataclasses.asdict(cfg)
    other = sorted(k for k in new if new[k] != old[k] and k not in STAGE_MODEL_FIELDS)
    if other:
        raise ValueError(f"a stage may change only {', '.join(STAGE_MODEL_FIELDS)} of the model, "
                         f"not {', '.join(other)}")
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset(cfg)
        elif isinstance(module, MLAttention):
            module.scale = softmax_scale(cfg)
    model.config = cfg
