"""Tests for the mixture loader: packing, mixture weights, validation split, resume and baseline."""

import json
import math

import numpy as np
import pytest
import torch

from openk2.data.corpus import CorpusConfig, tokenize_corpus, tokenizer_training_texts
from openk2.data.loader import PackedLoader
from openk2.data.packing import IGNORE_INDEX
from openk2.data.sources import SourceConfig
from openk2.data.tokenizer import train_tokenizer
from openk2.data.unigram import unigram_baseline


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loader")
    notes = [json.dumps({"text": f"note {i}: " + "ab " * (i % 7)}) + "\n" for i in range(60)]
    (tmp / "notes.jsonl").write_text("".join(notes))
    cfg = CorpusConfig(
        sources=[
            SourceConfig(kind="shakespeare", weight=0.5, max_chars=150_000),
            SourceConfig(kind="math", weight=0.3, num_docs=600),
            SourceConfig(kind="jsonl", name="notes", weight=0.2, path=str(tmp / "notes.jsonl")),
        ],
        seq_len=64,
        val_fraction=0.1,
        doc_chars=1000,
    )
    tok = train_tokenizer(tokenizer_training_texts(cfg, 100_000), 800)
    return cfg, tok


def take(loader, n):
    return [b for _, b in zip(range(n), loader, strict=False)]


def stream_of(batches):
    rows = [r for b in batches for r in b["input_ids"].tolist()]
    return rows[0] + [t for r in rows[1:] for t in r[1:]]


def doc_index(cfg, tok, split):
    corpus = tokenize_corpus(cfg, tok)
    return {
        tuple(td.doc(i).tolist()): name
        for name, per in corpus.docs.items()
        for td in [per[split]]
        for i in range(len(td))
    }


def split_stream(stream, eos):
    docs, cur = [], []
    for t in stream:
        if t == eos:
            docs.append(tuple(cur))
            cur = []
        else:
            cur.append(t)
    return docs  # the trailing partial document is dropped


def test_batch_format(setup):
    cfg, tok = setup
    batch = next(iter(PackedLoader(cfg, tok, batch_size=3)))
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    for v in batch.values():
        assert v.shape == (3, 64) and v.dtype == torch.long
    ids, labels = batch["input_ids"], batch["labels"]
    keep = labels != IGNORE_INDEX
    assert torch.equal(labels[keep], ids[keep])
    follows_eos = torch.zeros_like(keep)
    follows_eos[:, 1:] = ids[:, :-1] == tok.eos_id
    assert torch.equal(~keep[:, 1:], follows_eos[:, 1:])


def test_whole_documents_in_order_and_mixture(setup):
    cfg, tok = setup
    loader = PackedLoader(cfg, tok, batch_size=8)
    batches = take(loader, 60)
    stream = stream_of(batches)
    index = doc_index(cfg, tok, "train")
    docs = split_stream(stream, tok.eos_id)
    assert all(d in index for d in docs)  # every packed document is a whole training document
    counts = {name: 0 for name in cfg.weights}
    for d in docs:
        counts[index[d]] += len(d) + 1
    total = sum(counts.values())
    for name, w in cfg.weights.items():
        assert abs(counts[name] / total - w) < 0.03, (counts, cfg.weights)
    assert loader.epochs["notes"] >= 1  # the small source has wrapped around
    assert loader.batches == 60


def test_deterministic(setup):
    cfg, tok = setup
    a = take(PackedLoader(cfg, tok, batch_size=4), 10)
    b = take(PackedLoader(cfg, tok, batch_size=4), 10)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b, strict=True))


def test_resume_is_exact(setup):
    cfg, tok = setup
    uninterrupted = PackedLoader(cfg, tok, batch_size=4)
    reference = take(uninterrupted, 70)
    first = PackedLoader(cfg, tok, batch_size=4)
    take(first, 37)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = PackedLoader(cfg, tok, batch_size=4)
    resumed.load_state_dict(state)
    assert resumed.batches == 37
    rest = take(resumed, 33)
    for want, got in zip(reference[37:], rest, strict=True):
        for key in want:
            assert torch.equal(want[key], got[key])
    assert resumed.state_dict() == uninterrupted.state_dict()
    assert resumed.epochs["notes"] >= 1  # the resumed run crossed an epoch boundary


def test_zero_weight_source_is_skipped(setup):
    cfg, tok = setup
    off = CorpusConfig.from_dict(
        {
            **cfg.to_dict(),
            "sources": [*cfg.to_dict()["sources"][:2], {**cfg.to_dict()["sources"][2], "weight": 0}],
        }
    )
    loader = PackedLoader(off, tok, batch_size=4)
    assert set(loader.corpus.docs) == {"shakespeare", "math"}
    take(loader, 20)
    assert set(loader.tokens_emitted) == {"shakespeare", "math"}


def test_state_mismatch(setup):
    cfg, tok = setup
    state = PackedLoader(cfg, tok, batch_size=2).state_dict()
    with pytest.raises(ValueError, match="different corpus"):
        PackedLoader(cfg, tok, batch_size=2, split="val").load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        PackedLoader(cfg, tok, batch_size=2).load_state_dict({**state, "version": 99})


def test_validation_split(setup):
    cfg, tok = setup
    train_docs, val_docs = doc_index(cfg, tok, "train"), doc_index(cfg, tok, "val")
    assert val_docs and not set(val_docs) & set(train_docs)
    val = PackedLoader(cfg, tok, batch_size=2, split="val", loop=False)
    batches = list(val)
    assert batches and all(d in val_docs for d in split_stream(stream_of(batches), tok.eos_id))
    assert all(e == 1 for e in val.epochs.values())
    again = list(PackedLoader(cfg, tok, batch_size=2, split="val", loop=False))
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(batches, again, strict=True))


def test_loader_errors(setup):
    cfg, tok = setup
    with pytest.raises(ValueError, match="split"):
        PackedLoader(cfg, tok, 2, split="test")
    with pytest.raises(ValueError, match="batch_size"):
        PackedLoader(cfg, tok, 0)
    no_val = CorpusConfig(sources=cfg.sources, seq_len=64, val_fraction=0.0, doc_chars=1000)
    with pytest.raises(ValueError, match="no val documents"):
        PackedLoader(no_val, tok, 2, split="val")


def test_unigram_baseline_tokens():
    assert unigram_baseline([0, 1, 2, 3] * 100, [0, 1, 2, 3]) == pytest.approx(math.log(4), rel=1e-3)
    assert unigram_baseline([0] * 1000, [0], vocab_size=10) < 0.01
    rng = np.random.default_rng(0)
    skewed = rng.choice(50, size=20_000, p=np.r_[0.5, np.full(49, 0.5 / 49)])
    assert unigram_baseline(skewed[:15_000], skewed[15_000:]) < math.log(50)
    with pytest.raises(ValueError, match="val_tokens"):
        unigram_baseline([1, 2, 3])


def test_unigram_baseline_loader(setup):
    cfg, tok = setup
    ce = unigram_baseline(PackedLoader(cfg, tok, 2))
    assert 2.0 < ce < math.log(tok.vocab_size)
    # Close to the direct estimate on what the val loader actually serves.
    val = list(PackedLoader(cfg, tok, 8, split="val", loop=False))
    train = list(PackedLoader(cfg, tok, 8, split="train", loop=False))
    targets = lambda bs: torch.cat([b["labels"][:, 1:].flatten() for b in bs])  # noqa: E731
    t, v = targets(train), targets(val)
    direct = unigram_baseline(t[t >= 0].numpy(), v[v >= 0].numpy(), vocab_size=tok.vocab_size)
    assert ce == pytest.approx(direct, rel=0.1)


def reference_batches(cfg, tok, batch_size, n):
    """The loader's documented rule written the direct way: pull documents by the mixture rule into a Packer."""
    import zlib

    from openk2.data.packing import Packer, collate

    docs = {name: per["train"] for name, per in tokenize_corpus(cfg, tok).docs.items() if len(per["train"])}
    weights, packer = cfg.weights, Packer(cfg.seq_len, tok.eos_id)
    epoch, cursor, emitted = (dict.fromkeys(docs, 0) for _ in range(3))
    out = []
    for _ in range(n):
        rows = []
        while len(rows) < batch_size:
            while not packer.ready():
                name = min(docs, key=lambda s: emitted[s] / weights[s])
                rng = np.random.default_rng([cfg.seed, zlib.crc32(name.encode()), epoch[name]])
                doc = docs[name].doc(int(rng.permutation(len(docs[name]))[cursor[name]]))
                cursor[name] += 1
                if cursor[name] == len(docs[name]):
                    epoch[name], cursor[name] = epoch[name] + 1, 0
                emitted[name] += len(doc) + 1
                packer.add(doc)
            rows.append(packer.pop_row())
        out.append(collate(rows))
    return out


def test_batches_follow_the_packing_rule(setup):
    cfg, tok = setup
    got = take(PackedLoader(cfg, tok, batch_size=3), 40)
    for want, have in zip(reference_batches(cfg, tok, 3, 40), got, strict=True):
        assert all(torch.equal(want[k], have[k]) for k in want)
