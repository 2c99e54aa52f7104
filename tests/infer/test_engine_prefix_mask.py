"""Regression: one prefill batch whose rows end at the same length but start at different prefix-cache hits."""

from __future__ import annotations

import torch

from openk2.infer.engine import Engine, SamplingParams

from .test_engine import assert_matches_full_forward, make_model, prompts_of

BS = 8


def test_rows_with_equal_totals_and_unequal_prefix_hits_see_their_whole_context():
    torch.set_num_threads(1)
    model = make_model()
    shared, mid_a, mid_b, end_a, end_b = prompts_of([8, 16, 16, 6, 6], model.config.vocab_size)
    engine = Engine(model, max_batch_size=4, max_seq_len=64, block_size=BS)
    engine.generate([shared + mid_a + [1]], SamplingParams(temperature=0, max_tokens=1))  # caches 3 blocks
    # Both 30 tokens long: the first hits 24 cached tokens (6 to compute), the second only 8 (22 to compute),
    # so one prefill batch holds a 6-token row padded to 22 and both rows end at position 30.
    params = SamplingParams(temperature=0, max_tokens=3, return_logits=True)
    results = engine.generate([shared + mid_a + end_a, shared + mid_b + end_b], params)
    for r in results:
        assert_matches_full_forward(model, r)
