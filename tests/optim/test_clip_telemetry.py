"""QK-Clip telemetry: the probe cadence, a step's ClipStats record, the window of clipping between logs."""

import pytest
import torch

from openk2.optim.muonclip import ClipStats, ClipWindow, max_logits_due


def test_probe_cadence_runs_every_step_while_clipping_else_every_n():
    assert all(max_logits_due(step, 100.0, every=0) for step in range(1, 6))  # clipping needs every step
    assert [s for s in range(1, 11) if max_logits_due(s, None, every=4)] == [4, 8]
    assert [s for s in range(1, 4) if max_logits_due(s, None, every=1)] == [1, 2, 3]
    assert not any(max_logits_due(s, None, every=0) for s in range(1, 6))
    with pytest.raises(ValueError, match="max_logit_every must be >= 0"):
        max_logits_due(1, None, every=-1)


def test_clip_stats_record_has_per_layer_max_and_share_and_omits_unprobed_logits():
    max_logits = torch.tensor([[5.0, 120.0, 90.0, 101.0], [3.0, 4.0, 2.0, 1.0]])
    gamma = torch.where(max_logits > 100, 100 / max_logits, torch.ones_like(max_logits))
    record = ClipStats(max_logits, gamma).as_dict()
    assert record["clipped_heads"] == 2 and record["clipped_share"] == 2 / 8
    assert record["clipped_heads_per_layer"] == [2, 0]
    assert record["max_logit_per_layer"] == [120.0, 4.0] and record["max_logit"] == 120.0
    unprobed = ClipStats(torch.full((2, 4), float("-inf")), torch.ones(2, 4)).as_dict()
    assert "max_logit" not in unprobed and "max_logit_per_layer" not in unprobed
    assert unprobed["clipped_heads"] == 0


def test_clip_window_collects_heads_and_steps_then_resets():
    window = ClipWindow()
    ones = torch.ones(2, 3)
    window.add(1, ClipStats(torch.zeros(2, 3), torch.tensor([[1.0, 0.5, 1.0], [1.0, 1.0, 1.0]])))
    window.add(2, ClipStats(torch.zeros(2, 3), ones))
    window.add(3, ClipStats(torch.zeros(2, 3), torch.tensor([[1.0, 0.9, 1.0], [0.8, 1.0, 1.0]])))
    assert window.pop() == {"window_clipped_heads": [[0, 1], [1, 0]], "window_clip_steps": [1, 3]}
    assert window.pop() == {"window_clipped_heads": [], "window_clip_steps": []}
