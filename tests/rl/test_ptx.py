"""PTX data: curated passages of the shipped Shakespeare text, not the RL task's own solutions."""

import torch

from openk2.data.tokenizer import train_tokenizer
from openk2.rl.config import LossSection
from openk2.rl.ptx import MIN_CHARS, PTXStream, curated_passages, keep_passage


def test_quality_filter():
    verse = "Now is the winter of our discontent made glorious summer by this sun of York. " * 4
    assert keep_passage(verse)
    assert not keep_passage("ACT I. SCENE 1.")  # too short
    assert not keep_passage(verse + " This eBook is for the use of anyone, see the Project Gutenberg License.")
    assert not keep_passage("x = [1, 2, 3]; y = {k: v for k, v in z.items()}  # code, not prose\n" * 5)


def test_curated_stream_is_seeded_shakespeare_text():
    passages = curated_passages("shakespeare", seed=3, limit=50)
    assert len(passages) == 50 and all(len(p) >= MIN_CHARS for p in passages)
    assert passages == curated_passages("shakespeare", seed=3, limit=50)
    assert passages != curated_passages("shakespeare", seed=4, limit=50)
    assert not any("Answer:" in p for p in passages)  # not the arithmetic task's worked solutions
    tokenizer = train_tokenizer(passages, 600)
    cfg = LossSection(ptx_weight=0.1, ptx_tokens=16, ptx_batch=4)
    first, second = PTXStream(tokenizer, cfg, seed=3), PTXStream(tokenizer, cfg, seed=3)
    batch = first.batch()
    assert batch.shape == (4, 16) and batch.dtype == torch.long
    assert torch.equal(batch, second.batch())
    text = tokenizer.decode(batch[0].tolist())
    assert any(text[:20] in p for p in curated_passages("shakespeare", seed=3))
