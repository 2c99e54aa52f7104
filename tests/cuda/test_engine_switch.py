"""Engine switching on CUDA (`pytest -m cuda tests/cuda`): the policy and MuonClip's state leave the GPU during
the rollout, device memory drops, and after the reload the next step is bit-identical to one without it."""

import pytest
import torch

from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM
from openk2.rl.config import OptimSection
from openk2.rl.engine_switch import TrainingStateOffload
from openk2.rl.trainer import build_rl_optimizer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason=f"needs a CUDA GPU (torch {torch.__version__} sees none)"),
]


def _step(model, optimizer, ids):
    loss = model(ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    optimizer.step(None)
    optimizer.zero_grad()


def _setup():
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny").replace(vocab_size=256, num_hidden_layers=2, n_routed_experts=4)
    model = K2ForCausalLM(cfg).cuda()
    optimizer = build_rl_optimizer(model, OptimSection(lr=1e-3, optimizer="muon", qk_clip_tau=100.0))
    ids = torch.randint(0, 256, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    _step(model, optimizer, ids)  # the optimizer now has state (momentum, AdamW moments and step)
    return model, optimizer, ids


def _snapshot(model, optimizer) -> dict:
    out = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for k, opt in enumerate(optimizer.optimizers):
        for i, state in enumerate(opt.state.values()):
            out.update({f"opt{k}/{i}/{key}": v.clone() for key, v in state.items() if torch.is_tensor(v)})
    return out


def test_offload_frees_device_memory_and_reload_is_exact():
    model, optimizer, ids = _setup()
    before = _snapshot(model, optimizer)
    assert any(k.startswith("opt") for k in before)
    switch = TrainingStateOffload(model, optimizer)
    assert switch.active
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    with switch.during_rollout() as moved:
        assert moved and all(p.device.type == "cpu" for p in model.parameters())
        assert torch.cuda.memory_allocated() < held / 4  # parameters and optimizer state left the device
    after = _snapshot(model, optimizer)
    for name, value in before.items():  # every tensor back, bit-exact, on the device it came from
        assert after[name].device == value.device and torch.equal(after[name], value), name
    _step(model, optimizer, ids)  # and training continues on the GPU
    assert all(p.device.type == "cuda" for p in model.parameters())
