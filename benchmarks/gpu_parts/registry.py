"""The parts of the GPU check in run order, each with the time it may take on CUDA and in a --quick CPU run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """One independent part: `target` is "module:function" under gpu_parts, called with a PartContext."""

    name: str
    title: str
    target: str
    limit_s: float  # on CUDA, full sizes
    quick_limit_s: float  # --quick (the CPU dry run)

    def limit(self, quick: bool) -> float:
        return self.quick_limit_s if quick else self.limit_s


PARTS: tuple[Part, ...] = (
    Part("env", "machine, versions, bf16 matmul ceiling", "env:run", 40, 30),
    Part("hf_logits", "logits vs HF DeepseekV3 (fp32, bf16)", "checks:hf_logits", 60, 40),
    Part("muon_vs_torch", "Muon vs torch.optim.Muon (2-D, 3-D experts split to 2-D)", "checks:muon_vs_torch", 30, 20),
    Part("qk_clip", "QK-Clip invariant", "checks:qk_clip", 30, 20),
    Part("fp8_activations", "FP8 activation storage round-trip", "checks:fp8_activations", 30, 20),
    Part("offload", "CPU offload exactness", "checks:offload", 30, 20),
    Part("engine_decode", "engine cached decode vs full forward", "checks:engine_decode", 45, 20),
    Part("cuda_tests", "pytest -m cuda tests/cuda", "pytest_part:run", 120, 60),
    Part("train_step", "train step tok/s and MFU vs HF DeepseekV3", "train:run", 150, 60),
    Part("muon_step", "Muon step time vs torch.optim.Muon", "muon_step:run", 60, 30),
    Part("probe", "max-logit probe overhead", "probe:run", 60, 30),
    Part("decode", "decode tok/s vs HF generate", "decode:run", 150, 60),
)
BY_NAME = {p.name: p for p in PARTS}
