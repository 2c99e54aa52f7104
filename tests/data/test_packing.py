"""Tests for packing documents into rows with document-aware labels and position ids."""

import numpy as np
import pytest

from openk2.data.packing import IGNORE_INDEX, Packer, collate, row_labels, row_positions

EOS = 0


def pack(docs, seq_len):
    packer = Packer(seq_len, EOS)
    rows = []
    for d in docs:
        packer.add(np.array(d))
        while packer.ready():
            rows.append(packer.pop_row())
    return rows, packer


def test_worked_example():
    rows, _ = pack([[1, 2, 3], [4, 5], [6]], seq_len=4)
    # stream: 1 2 3 EOS 4 5 EOS 6 EOS; each row starts with the previous row's last token
    assert [t.tolist() for t, _ in rows] == [[1, 2, 3, 0], [0, 4, 5, 0], [0, 6, 0]][:2]
    batch = collate(rows)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [0, 4, 5, 0]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 2, 3, 0], [0, IGNORE_INDEX, 5, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 0, 1, 2]]
    assert all(v.dtype.is_floating_point is False and v.shape == (2, 4) for v in batch.values())


def test_every_token_in_order_and_masking_rule():
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50, size=rng.integers(1, 30)).tolist() for _ in range(200)]
    seq_len = 16
    rows, packer = pack(docs, seq_len)
    stream = [t for d in docs for t in [*d, EOS]]
    rebuilt = (
        rows[0][0].tolist() + [t for r, _ in rows[1:] for t in r[1:].tolist()] + packer.tokens[1:].tolist()
    )
    assert rebuilt == stream
    for tokens, starts in rows:
        labels, pos = row_labels(tokens, starts), row_positions(starts)
        assert len(tokens) == seq_len
        for t in range(1, seq_len):
            # Target at t is masked exactly when it is the first token of a document (it follows EOS).
            assert (labels[t] == IGNORE_INDEX) == (tokens[t - 1] == EOS)
            if labels[t] != IGNORE_INDEX:
                assert labels[t] == tokens[t]
            assert pos[t] == (0 if tokens[t - 1] == EOS else pos[t - 1] + 1)
        assert pos[0] == 0


def test_state_round_trip():
    a = Packer(8, EOS)
    a.add(np.array([5, 6, 7]))
    a.add(np.array([8, 9]))
    b = Packer(8, EOS)
    b.load_state_dict(a.state_dict())
    for p in (a, b):
        p.add(np.array([1, 2, 3, 4]))
    ra, rb = a.pop_row(), b.pop_row()
    assert (ra[0] == rb[0]).all() and (ra[1] == rb[1]).all()
    assert a.state_dict() == b.state_dict()


def test_errors():
    with pytest.raises(ValueError, match="seq_len"):
        Packer(1, EOS)
    with pytest.raises(ValueError, match="buffered"):
        Packer(4, EOS).pop_row()
