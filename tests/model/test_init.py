"""Weight initialisation does not depend on the default device: values are drawn on the CPU and copied."""

from __future__ import annotations

import torch

from openk2.model import K2ForCausalLM
from openk2.model.init import init_weights
from tests.model.conftest import small_config


def test_init_under_another_default_device_draws_the_same_values_on_the_cpu():
    config = small_config()
    model = K2ForCausalLM(config)
    mlp = model.model.layers[0].mlp  # plain Linear layers: every tensor goes through the seeded normal draw
    init_weights(mlp, config, seed=7)
    expected = {name: p.clone() for name, p in mlp.named_parameters()}
    for p in mlp.parameters():
        p.data.zero_()
    # A `meta` default device stands in for `with torch.device("cuda")`: a draw that followed the default
    # device would fail to copy into the CPU tensors (or, on CUDA, meet the CPU generator).
    with torch.device("meta"):
        init_weights(mlp, config, seed=7)
    for name, p in mlp.named_parameters():
        torch.testing.assert_close(p, expected[name], rtol=0, atol=0, msg=name)
