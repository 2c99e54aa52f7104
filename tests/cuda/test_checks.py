"""The GPU check's correctness parts as CUDA-marked tests (`pytest -m cuda tests/cuda`): HF logits, Muon vs
torch.optim.Muon, QK-Clip, FP8 activations, CPU offload, engine decode (benchmarks/gpu_parts/correctness.py);
SDPA's fused kernels at K2's 192/128 head dims; the model built on the CUDA default device. Skipped on a machine
without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

from gpu_parts.context import PartSkipped  # noqa: E402
from gpu_parts.correctness import CHECKS  # noqa: E402
from gpu_parts.sizes import check_config  # noqa: E402

from openk2 import K2ForCausalLM  # noqa: E402
from openk2.model.attention import segment_causal_mask  # noqa: E402
from openk2.model.attention_core import attend  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason=f"needs a CUDA GPU (torch {torch.__version__} sees none)"),
]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("name", list(CHECKS))
def test_correctness_check_on_cuda(name):
    try:
        measured = CHECKS[name](CUDA)
    except PartSkipped as err:
        pytest.skip(str(err))
    assert measured  # the check raised AssertionError with its numbers if a bound was broken


@pytest.mark.parametrize("backend,masked", [(SDPBackend.FLASH_ATTENTION, False),
                                            (SDPBackend.EFFICIENT_ATTENTION, True)])
def test_attend_reaches_a_fused_kernel_with_k2_head_dims(backend, masked):
    """q/k 192, v 128 in bf16: SDPA alone could only use its math kernel; `attend` pads v and must run on the
    fused kernel it documents (flash when causal, memory-efficient with a mask), forward and backward."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 256, 192, generator=g).to(CUDA, torch.bfloat16).requires_grad_() for _ in range(2))
    v = torch.randn(2, 4, 256, 128, generator=g).to(CUDA, torch.bfloat16).requires_grad_()
    mask = segment_causal_mask(torch.tensor([[0] * 100 + [1] * 156] * 2, device=CUDA)) if masked else None
    with sdpa_kernel([backend]):
        out = attend(q, k, v, 192 ** -0.5, mask)
        out.float().sum().backward()
    assert out.shape == (2, 4, 256, 128) and torch.isfinite(out).all() and torch.isfinite(v.grad).all()
    ref = attend(*(x.detach().float() for x in (q, k, v)), 192 ** -0.5, mask)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2  # bf16 inputs, fp32 reference


def test_model_built_on_the_cuda_default_device_has_the_cpu_weights():
    """K2ForCausalLM builds "on the current default device" with weights drawn on the CPU (model/init.py):
    under `with torch.device("cuda")` it must give the CPU build's tensors, bit for bit."""
    cpu = K2ForCausalLM(check_config(), init_seed=3)
    with torch.device(CUDA):
        gpu = K2ForCausalLM(check_config(), init_seed=3)
    for (name, a), (_, b) in zip(cpu.state_dict().items(), gpu.state_dict().items(), strict=True):
        assert b.device.type == "cuda" and torch.equal(a, b.cpu()), name
