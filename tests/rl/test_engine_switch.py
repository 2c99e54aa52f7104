"""Engine switching hooks on a machine without a policy on CUDA: offload and reload leave everything in place."""

import torch

from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM
from openk2.rl.config import OptimSection
from openk2.rl.engine_switch import TrainingStateOffload
from openk2.rl.trainer import build_rl_optimizer


def test_offload_is_a_no_op_for_a_cpu_policy():
    torch.manual_seed(0)
    model = K2ForCausalLM(ModelConfig.preset("tiny").replace(vocab_size=64, num_hidden_layers=1, hidden_size=32,
                                                             intermediate_size=64))
    optimizer = build_rl_optimizer(model, OptimSection())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    switch = TrainingStateOffload(model, optimizer)
    assert not switch.active
    with switch.during_rollout() as moved:
        assert moved is False
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
