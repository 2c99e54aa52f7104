"""The `[parallel]` run-config section: how many ranks go to data, expert and pipeline parallelism.

World layout (K2 report, section 2.4): world = pp x dp x ep. The pp x ep ranks of one data-parallel
replica form the model-parallel group (256 GPUs for K2: 16 PP x 16 EP); each EP rank reads its own
tokens, so dense weights are data-parallel over dp x ep ranks and routed experts over dp ranks.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

# Schedule names accepted by `parallel.pp_schedule` -> torch.distributed.pipelining class names.
PP_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
}
# Schedules that drive one stage per rank; the others drive pp_virtual_stages stages per rank.
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
BACKENDS = ("auto", "gloo", "nccl")
PARAM_DTYPE_NAMES = ("float32", "bfloat16")
# Not run under fsdp2 with pp > 1 (untested): zero-bubble schedules split each backward into input and weight passes.
FSDP2_REFUSED_SCHEDULES = ("interleaved_zero_bubble", "zbv_zero_bubble")
SHARD_MODES = ("zero1", "fsdp2")  # data-parallel sharding: optimizer state only, or weights and gradients too


@dataclass(kw_only=True)
class ParallelConfig:
    dp: int = 1  # data-parallel replicas (ZeRO-1: optimizer state sharded over them)
    ep: int = 1  # expert-parallel ranks; routed experts are split evenly over them
    pp: int = 1  # pipeline stages ranks (each rank holds pp_virtual_stages stages)
    pp_virtual_stages: int = 1  # stages per pipeline rank (interleaved schedules); K2 uses > 1
    pp_schedule: str = "interleaved_1f1b"  # one of PP_SCHEDULES; micro-batches per step = train.grad_accum
    # Forwards added to each pipeline rank's warm-up under interleaved_1f1b, beyond torch's own count (the K2
    # report, section 2.4: more warm-up micro-batches let EP all-to-all overlap computation); each one costs a
    # stage-micro-batch of activations on every rank (train/parallel/warmup_schedule.py).
    pp_extra_warmup: int = 0
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    # Weight storage: "float32" (weights are their own masters) or "bfloat16" (the report's bf16 parameters,
    # fp32 gradient accumulation, fp32 masters sharded with the optimizer state; see train/parallel/mixed.py).
    param_dtype: str = "float32"
    # "zero1" (the report's: weights replicated over dp, optimizer state sharded) or "fsdp2" (ZeRO-3 with torch's
    # fully_shard: weights, gradients and optimizer state sharded over dp; train/parallel/fsdp.py).
    shard: str = "zero1"
    # With ep > 1: run the shared expert (and the balance loss) while the EP dispatch all-to-all is in flight, in
    # forward and backward (train/parallel/expert.py); bit-identical to false, which waits at once.
    ep_overlap: bool = True
    # ZeRO-1: reduce gradient buckets of grad_bucket_numel elements from backward hooks during the step's last
    # backward (train/parallel/grad_hooks.py); bit-identical to false, which reduces them all after backward.
    overlap_grad_reduce: bool = True
    grad_bucket_numel: int = 1 << 22

    def __post_init__(self) -> None:
        for name in ("dp", "ep", "pp", "pp_virtual_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be at least 1, got {getattr(self, name)}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"parallel.pp_schedule must be one of {sorted(PP_SCHEDULES)}, got {self.pp_schedule!r}")
        if self.pp_extra_warmup < 0:
            raise ValueError(f"parallel.pp_extra_warmup must be at least 0, got {self.pp_extra_warmup}")
        if self.pp_extra_warmup and self.pp_schedule != "interleaved_1f1b":
            raise ValueError(f"parallel.pp_extra_warmup applies to pp_schedule=interleaved_1f1b only, "
                             f"got pp_schedule={self.pp_schedule}")
        if self.pp_extra_warmup and self.pp == 1:
            warnings.warn("parallel.pp_extra_warmup with parallel.pp=1 has no pipeline to warm up: it is ignored",
                          stacklevel=2)
        if self.pp_schedule in SINGLE_STAGE_SCHEDULES and self.pp_virtual_stages != 1:
            raise ValueError(f"parallel.pp_schedule={self.pp_schedule} runs one stage per rank; "
                             f"set pp_virtual_stages=1 or pick an interleaved schedule")
        if self.pp_schedule == "zbv_zero_bubble" and self.pp_virtual_stages != 2:
            raise ValueError("parallel.pp_schedule=zbv_zero_bubble needs exactly pp_virtual_stages=2 (V shape)")
        if self.param_dtype not in PARAM_DTYPE_NAMES:
            raise ValueError(f"parallel.param_dtype must be one of {PARAM_DTYPE_NAMES}, got {self.param_dtype!r}")
        if self.grad_bucket_numel < 1:
            raise ValueError(f"parallel.grad_bucket_numel must be at least 1, got {self.grad_bucket_numel}")
        if self.shard not in SHARD_MODES:
            raise ValueError(f"parallel.shard must be one of {SHARD_MODES}, got {self.shard!r}")
        if self.shard == "fsdp2" and self.pp > 1 and self.pp_schedule in FSDP2_REFUSED_SCHEDULES:
            raise ValueError(f"parallel.shard=fsdp2 with pp > 1 runs schedules with a whole backward only, got "
                             f"pp_schedule={self.pp_schedule}; use interleaved_1f1b, 1f1b, gpipe or looped_bfs")
        if self.shard == "fsdp2" and self.dp * self.ep == 1 and self.pp > 1:
            raise ValueError("parallel.shard=fsdp2 with pp > 1 needs dp x ep > 1 ranks to shard over; "
                             "use parallel.shard=zero1")
        if self.shard == "fsdp2" and self.dp * self.ep == 1:
            warnings.warn("parallel.shard=fsdp2 with parallel.dp=ep=1 has nothing to shard: it is ignored",
                          stacklevel=2)
        if self.backend not in BACKENDS:
            raise ValueError(f"parallel.backend must be one of {BACKENDS}, got {self.backend!r}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all (each rank holds pp_virtual_stages of them)."""
        return self.pp * self.pp_virtual_stages

    @property
    def enabled(self) -> bool:
        return self.world_size > 1
