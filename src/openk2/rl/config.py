"""RL run configuration: one TOML file (`configs/rl-tiny.toml`), one section per component, `--set` overrides.

Sections: [model] (preset + overrides, or `checkpoint` to start from a saved policy), [warmup] (the short
supervised warm-up that teaches the answer format), [task], [[envs]] (the environment mixture; without it the
one environment is [task]), [rollout], [loss], [optim], [train].
Unknown keys and values of the wrong type are a ValueError naming the key and its file (`openk2.configfile`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openk2.config import ModelConfig
from openk2.configfile import (
    build_named_tables,
    build_section,
    check_keys,
    check_table,
    check_type,
    load_config,
    table_errors,
)
from openk2.rl import tasks

TEMPERATURE_SCHEDULES = ("linear", "cosine", "exponential")
INFERENCE_DTYPES = ("fp32", "bf16")
# an environment's reward: its task's verifier, or the policy's own critic (openk2.rl.critic_env)
ENV_REWARDS = ("verifier", "self-critique", "self-critique-rubric")


@dataclass(kw_only=True)
class WarmupSection:
    """Supervised warm-up on generated, worked solutions in the task's prompt/answer format."""

    steps: int = 300  # optimizer steps; 0 skips the warm-up (the policy then starts untrained)
    batch_size: int = 32
    lr: float = 3e-3
    tokenizer_examples: int = 4000  # worked examples the BPE tokenizer is trained on
    # adaptive stop for tool environments (rl/tool_probe.py): with probe_problems > 0, the greedy success on that
    # many probe problems (never held out, never trained on) is checked every probe_every steps, and the warm-up
    # ends at the first check at or above probe_low (within [probe_low, probe_high] unless it jumped past it);
    # `steps` is then the cap
    probe_problems: int = 0
    probe_every: int = 10
    probe_low: float = 0.2
    probe_high: float = 0.6
    # share of the arithmetic warm-up's examples written as worked compact critic verdicts instead (the right
    # letter for a worked solution against a slipped one; rl/critic_compact.py); 0: worked solutions only
    verdict_share: float = 0.0

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError("warmup.steps must be >= 0, warmup.batch_size >= 1 and warmup.lr > 0")
        if not 0.0 <= self.verdict_share < 1.0:
            raise ValueError(f"warmup.verdict_share must be in [0, 1), got {self.verdict_share}")
        if self.probe_problems < 0 or self.probe_every < 1 or not 0.0 <= self.probe_low <= self.probe_high <= 1.0:
            raise ValueError("warmup.probe_problems must be >= 0, probe_every >= 1 and 0 <= probe_low <= probe_high "
                             f"<= 1, got {self.probe_problems}, {self.probe_every}, {self.probe_low}, "
                             f"{self.probe_high}")


@dataclass(kw_only=True)
class TaskSection:
    name: str = "arithmetic"  # an openk2.rl.tasks name
    difficulties: list[int] = field(default_factory=lambda: [1, 2, 3])  # levels problems are drawn from
    eval_problems: int = 128  # held-out problems (their expressions never appear in warm-up or RL prompts)
    eval_samples: int = 1  # samples per held-out problem at T = 1 (eval_reward_sampled is their mean reward)
    eval_seed: int = -1  # seed of the held-out draw; -1: train.seed (fix it to compare runs of several seeds)

    def __post_init__(self) -> None:
        if not self.difficulties:
            raise ValueError("task.difficulties must name at least one level")
        if self.eval_seed < -1:
            raise ValueError(f"task.eval_seed must be >= 0, or -1 for train.seed; got {self.eval_seed}")
        if self.eval_problems < 1 or self.eval_samples < 1:
            raise ValueError("task.eval_problems and task.eval_samples must be >= 1")


@dataclass(kw_only=True)
class EnvSection:
    """One `[[envs]]` entry: a verifiable task in the RL mixture, its share of new groups, its token budget and
    its curriculum by difficulty."""

    name: str  # an openk2.rl.tasks name; the metrics' per-environment keys end in "/<name>"
    task: str = ""  # the task to build when `name` is only a label (two envs over one task); "": `name`
    # (an import path "my_tasks:MyTask" names a task of your own that Ray rollout workers can rebuild too)
    weight: float = 1.0  # share of the new groups (weights are normalised over the envs)
    difficulties: list[int] = field(default_factory=lambda: [1])
    max_tokens: int = 0  # this environment's response budget; 0: rollout.max_tokens, else the task's own
    # curriculum: 0 draws every level from the start; N opens the levels (sorted) one by one, evenly over the
    # first N iterations, so the hardest level is drawn only from iteration N * (L - 1) / L on
    curriculum_iterations: int = 0
    eval_problems: int = 0  # held-out problems of this environment; 0: task.eval_problems
    # "verifier": task.verify; "self-critique" ("-rubric"): the policy as critic ranks each group's responses
    # (compact or rubric prompt; rl/critic_env.py). `task = "critic"` makes the critic's own environment.
    reward: str = "verifier"
    max_turns: int = 0  # a tool task's assistant turns per episode (rl/tool_episode.py); 0: the task's own
    # evaluated but never trained on: the new groups drawn for it are not started (the other envs keep the
    # problems they draw when it trains); a critic env still observes and evaluates (docs/rl.md, the control)
    eval_only: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("envs.name must name the environment")
        if self.max_turns < 0:
            raise ValueError(f"envs.max_turns must be >= 0, got {self.max_turns} for {self.name!r}")
        if self.reward not in ENV_REWARDS:
            raise ValueError(f"envs.reward must be one of {ENV_REWARDS}, got {self.reward!r} for {self.name!r}")
        if self.weight <= 0:
            raise ValueError(f"envs.weight must be > 0, got {self.weight} for {self.name!r}")
        if not self.difficulties:
            raise ValueError(f"envs.difficulties must name at least one level for {self.name!r}")
        if self.max_tokens < 0 or self.curriculum_iterations < 0 or self.eval_problems < 0:
            raise ValueError(f"envs.max_tokens, curriculum_iterations and eval_problems must be >= 0 ({self.name!r})")

    @property
    def task_name(self) -> str:
        return self.task or self.name

    def levels_at(self, iteration: int) -> list[int]:
        """The difficulty levels drawn from at `iteration` under the curriculum (all of them without one)."""
        levels = sorted(self.difficulties)
        if not self.curriculum_iterations:
            return levels
        opened = 1 + (len(levels) * max(iteration, 0)) // self.curriculum_iterations
        return levels[: min(len(levels), opened)]


@dataclass(kw_only=True)
class RolloutSection:
    prompts_per_iteration: int = 16  # new groups started each iteration
    samples_per_prompt: int = 8  # K in the K1.5 objective
    max_tokens: int = 0  # a response's budget; 0: the task's own max_tokens
    segment_tokens: int = 0  # partial rollout: new tokens per trajectory per iteration before pausing; 0: off
    max_batch_size: int = 128  # samples decoded together (concurrent rollouts)
    temperature: float = 1.0  # start of the temperature-decay schedule
    final_temperature: float = 1.0  # end of it (equal to `temperature`: no decay)
    temperature_decay_iterations: int = 1
    temperature_schedule: str = "cosine"
    # R3 (docs/rl.md): record each rollout token's MoE experts and replay them in the training forward
    routing_replay: bool = False
    mismatch_every: int = 1  # log the train/rollout mismatch (R3 off and on) every N iterations; 0: off
    inference_dtype: str = "fp32"  # the rollout copy of the policy: fp32, or bf16 as a serving engine runs it
    # where rollouts run (openk2.rl.placement, docs/rl.md "Placement"): "colocated" in the trainer's process, or
    # "ray": `num_workers` Ray actors, one placement-group bundle of `worker_num_cpus` / `worker_num_gpus` each
    placement: str = "colocated"
    num_workers: int = 1
    worker_num_cpus: float = 1.0
    worker_num_gpus: float = 0.0
    ray_address: str = ""  # a Ray cluster to join; "": $RAY_ADDRESS if set, else a local ray.init()
    worker_timeout_s: int = 600  # the weight-sync process group's timeout (a lost worker fails within it)

    def __post_init__(self) -> None:
        if self.placement not in ("colocated", "ray"):
            raise ValueError(f"rollout.placement must be colocated or ray, got {self.placement!r}")
        if self.num_workers < 1 or self.worker_num_cpus <= 0 or self.worker_num_gpus < 0 or self.worker_timeout_s < 1:
            raise ValueError("rollout.num_workers and worker_timeout_s must be >= 1, worker_num_cpus > 0 and "
                             "worker_num_gpus >= 0")
        if self.mismatch_every < 0:
            raise ValueError(f"rollout.mismatch_every must be >= 0, got {self.mismatch_every}")
        if self.inference_dtype not in INFERENCE_DTYPES:
            raise ValueError(f"rollout.inference_dtype must be one of {INFERENCE_DTYPES}, got {self.inference_dtype!r}")
        for name in ("prompts_per_iteration", "samples_per_prompt", "max_batch_size", "temperature_decay_iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.samples_per_prompt < 2:
            raise ValueError("rollout.samples_per_prompt must be >= 2 (rewards are centred within a group)")
        if self.max_tokens < 0 or self.segment_tokens < 0:
            raise ValueError("rollout.max_tokens and rollout.segment_tokens must be >= 0")
        if self.temperature_schedule not in TEMPERATURE_SCHEDULES:
            raise ValueError(f"rollout.temperature_schedule must be one of {TEMPERATURE_SCHEDULES}")
        if self.temperature <= 0 or self.final_temperature <= 0:
            raise ValueError("rollout temperatures must be > 0")


@dataclass(kw_only=True)
class LossSection:
    name: str = "k15"  # an openk2.rl.loss policy loss: k15 or grpo
    tau: float = 1.0  # K1.5: weight of log(pi / pi_old) in the squared residual
    clip_eps: float = 0.2  # GRPO only
    budget_penalty: float = 0.5  # subtracted from the reward of responses truncated at max_tokens
    ptx_weight: float = 0.0  # weight of the PTX language-model loss on the curated set (openk2.rl.ptx); 0: off
    ptx_source: str = "shakespeare"  # the shipped corpus source the curated PTX passages are cut from
    ptx_tokens: int = 64  # tokens per PTX row
    ptx_batch: int = 8  # PTX rows per training step
    # log pi(y|x) as the report writes it ("sum" over response tokens) or per token ("mean": the sum divided by
    # the response length, so long responses do not dominate the log-ratio term)
    logp_reduction: str = "sum"
    # leave out of the loss the groups whose K rewards are all equal (zero advantage: no reward signal, only the
    # regulariser); an iteration with none of them takes no optimizer step (docs/rl.md, the pipeline's RL stage)
    drop_uniform_groups: bool = True

    def __post_init__(self) -> None:
        if self.tau <= 0:
            raise ValueError(f"loss.tau must be > 0, got {self.tau}")
        if self.logp_reduction not in ("sum", "mean"):
            raise ValueError(f"loss.logp_reduction must be sum or mean, got {self.logp_reduction!r}")
        if self.ptx_weight < 0 or self.ptx_tokens < 2 or self.ptx_batch < 1:
            raise ValueError("loss.ptx_weight must be >= 0, loss.ptx_tokens >= 2 and loss.ptx_batch >= 1")


@dataclass(kw_only=True)
class OptimSection:
    # muon: MuonClip (as K2 trains RL with Muon); adamw: AdamW everywhere; sgd: SGD with momentum everywhere
    optimizer: str = "muon"
    momentum: float = 0.9  # sgd only
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # <= 0: off
    qk_clip_tau: float = 100.0

    def __post_init__(self) -> None:
        if self.optimizer not in ("muon", "adamw", "sgd"):
            raise ValueError(f"optim.optimizer must be muon, adamw or sgd, got {self.optimizer!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"optim.momentum must be in [0, 1), got {self.momentum}")
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")


@dataclass(kw_only=True)
class TrainSection:
    iterations: int = 40
    updates_per_iteration: int = 1  # optimizer steps on each iteration's completed groups (mini-batches)
    eval_every: int = 10
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    sync_bucket_mb: int = 16  # checkpoint-engine bucket size for the trainer -> inference weight update

    def __post_init__(self) -> None:
        for name in ("iterations", "updates_per_iteration", "eval_every", "checkpoint_every", "keep_checkpoints",
                     "sync_bucket_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(kw_only=True)
class RLConfig:
    model: ModelConfig
    checkpoint: str | None = None  # start from this HF-layout policy (with its tokenizer) instead of a warm-up
    warmup: WarmupSection = field(default_factory=WarmupSection)
    task: TaskSection = field(default_factory=TaskSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    loss: LossSection = field(default_factory=LossSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    envs: list[EnvSection] = field(default_factory=list)  # [[envs]]; empty: the one environment [task]
    out_dir: str = "runs/rl-tiny"

    def __post_init__(self) -> None:
        if self.rollout.placement == "ray":  # the workers rebuild tool tasks by name: fail here, not inside Ray
            for env in self.environments():
                tasks.check_rebuildable(env.task_name)

    def held_out_seed(self) -> int:
        """The seed the held-out problems are drawn with: `task.eval_seed`, or `train.seed` when it is -1."""
        return self.task.eval_seed if self.task.eval_seed >= 0 else self.train.seed

    def environments(self) -> list[EnvSection]:
        """The mixture: the [[envs]] entries, or one environment made of [task]."""
        if self.envs:
            return self.envs
        return [EnvSection(name=self.task.name, difficulties=list(self.task.difficulties),
                           eval_problems=self.task.eval_problems)]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RLConfig:
        raw = dict(raw)
        sections = {"model", "warmup", "task", "envs", "rollout", "loss", "optim", "train", "out_dir"}
        check_keys(raw, sections, "unknown section(s)")
        check_table(ModelConfig, "model", raw.get("model", {}), extra={"preset": str, "checkpoint": str})
        model = dict(raw.get("model", {}))
        preset = model.pop("preset", "tiny")
        checkpoint = model.pop("checkpoint", None)
        with table_errors("model"):
            if checkpoint is not None:
                if model:
                    raise ValueError("[model] checkpoint takes the shapes from the checkpoint; drop the other keys")
                model_cfg = ModelConfig.from_hf(checkpoint)
            else:
                model_cfg = ModelConfig.preset(preset).replace(**model) if model else ModelConfig.preset(preset)
        check_type(raw.get("out_dir", ""), str, "out_dir")
        return cls(
            model=model_cfg, checkpoint=checkpoint,
            warmup=build_section(WarmupSection, "warmup", raw.get("warmup", {})),
            task=build_section(TaskSection, "task", raw.get("task", {})),
            rollout=build_section(RolloutSection, "rollout", raw.get("rollout", {})),
            loss=build_section(LossSection, "loss", raw.get("loss", {})),
            optim=build_section(OptimSection, "optim", raw.get("optim", {})),
            train=build_section(TrainSection, "train", raw.get("train", {})),
            envs=build_named_tables(EnvSection, "envs", raw.get("envs", [])),
            out_dir=raw.get("out_dir", "runs/rl-tiny"),
        )

    def to_dict(self) -> dict[str, Any]:
        """The raw form `from_dict` reads back: a policy started from a checkpoint keeps `[model] checkpoint`
        (its shapes are the checkpoint's), any other has its full ModelConfig."""
        out = {name: dataclasses.asdict(getattr(self, name))
               for name in ("model", "warmup", "task", "rollout", "loss", "optim", "train")}
        if self.checkpoint is not None:
            out["model"] = {"checkpoint": self.checkpoint}
        if self.envs:
            out["envs"] = [dataclasses.asdict(e) for e in self.envs]
        out["out_dir"] = self.out_dir
        return out


def load_rl_config(path: str | Path | None, overrides: list[str] | None = None) -> RLConfig:
    """Read an RL TOML config (defaults when `path` is None; `base = "..."` inherits) and apply overrides; a bad
    key or value is a ValueError naming it and its file or `--set`."""
    return load_config(path, overrides, RLConfig.from_dict)


__all__ = ["EnvSection", "RLConfig", "load_rl_config"]
