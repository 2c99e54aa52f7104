"""Tests for corpus configuration, chunking, the validation split and cached tokenisation."""

import pytest

from openk2.data import corpus as corpus_mod
from openk2.data.corpus import (
    CorpusConfig,
    chunk_text,
    corpus_documents,
    load_corpus_config,
    split_documents,
    tokenize_corpus,
    tokenizer_training_texts,
)
from openk2.data.sources import SourceConfig
from openk2.data.tokenizer import train_tokenizer


def small_config(tmp_path, **kw) -> CorpusConfig:
    (tmp_path / "notes.jsonl").write_text("".join(f'{{"text": "note number {i}"}}\n' for i in range(40)))
    sources = [
        SourceConfig(kind="shakespeare", weight=2, max_chars=60_000),
        SourceConfig(kind="math", weight=1, num_docs=300),
        SourceConfig(kind="jsonl", name="notes", weight=1, path=str(tmp_path / "notes.jsonl")),
    ]
    return CorpusConfig(sources=sources, **{"seq_len": 64, "val_fraction": 0.1, "doc_chars": 2000, **kw})


def test_from_dict_and_toml(tmp_path):
    cfg = CorpusConfig.from_dict(
        {"seq_len": 128, "sources": [{"kind": "shakespeare", "weight": 0.4}, {"kind": "math", "weight": 0.6}]}
    )
    assert cfg.seq_len == 128 and [s.name for s in cfg.sources] == ["shakespeare", "math"]
    assert cfg.weights == pytest.approx({"shakespeare": 0.4, "math": 0.6})
    assert CorpusConfig.from_dict(cfg.to_dict()) == cfg
    toml = tmp_path / "c.toml"
    toml.write_text(
        '[data]\nseq_len = 32\n[[data.sources]]\nkind = "shakespeare"\nweight = 0.4\n'
        '[[data.sources]]\nkind = "math"\nnum_docs = 10\n'
    )
    cfg = load_corpus_config(toml)
    assert cfg.seq_len == 32 and cfg.sources[1].num_docs == 10 and cfg.sources[0].weight == 0.4


def test_defaults():
    cfg = CorpusConfig()
    assert [s.kind for s in cfg.sources] == ["shakespeare", "python-stdlib", "math"]
    assert sum(cfg.weights.values()) == pytest.approx(1.0)


def test_config_errors():
    with pytest.raises(ValueError, match=r"unknown corpus config keys \['batch', 'seqlen'\]"):
        CorpusConfig.from_dict({"seqlen": 10, "batch": 3})
    with pytest.raises(ValueError, match=r"unknown source config keys \['wieght'\]"):
        CorpusConfig.from_dict({"sources": [{"kind": "math", "wieght": 1}]})
    with pytest.raises(ValueError, match="must be a list"):
        CorpusConfig.from_dict({"sources": {"kind": "math"}})
    with pytest.raises(ValueError, match="table"):
        CorpusConfig.from_dict({"sources": ["math"]})
    with pytest.raises(ValueError, match="unique"):
        CorpusConfig(sources=[SourceConfig(kind="math"), SourceConfig(kind="math")])
    with pytest.raises(ValueError, match="positive weight"):
        CorpusConfig(sources=[SourceConfig(kind="math", weight=0)])
    with pytest.raises(ValueError, match="val_fraction"):
        CorpusConfig(val_fraction=1.0)
    with pytest.raises(ValueError, match="seq_len"):
        CorpusConfig(seq_len=1)


@pytest.mark.parametrize("max_chars", [1, 7, 50, 1000])
def test_chunk_text_joins_back(max_chars):
    text = "para one\nline two\n\npara two is longer than the rest of them\n\n\nthree\n" * 5
    chunks = chunk_text(text, max_chars)
    assert "".join(chunks) == text
    assert all(0 < len(c) <= max_chars for c in chunks)
    assert chunk_text("", 10) == []


def test_chunk_prefers_blank_lines():
    text = "aaaa\n\nbbbb\n\ncccc\n\n"
    assert chunk_text(text, 12) == ["aaaa\n\nbbbb\n\n", "cccc\n\n"]


def test_split_deterministic_and_disjoint():
    docs = [f"doc {i}" for i in range(100)]
    split = split_documents(docs, 0.1, seed=0, name="x")
    assert len(split["val"]) == 10 and len(split["train"]) == 90
    assert set(split["val"]).isdisjoint(split["train"])
    assert split == split_documents(docs, 0.1, seed=0, name="x")
    assert split != split_documents(docs, 0.1, seed=1, name="x")
    assert len(split_documents(docs[:3], 0.01, 0, "x")["val"]) == 1  # at least one when asked for any
    assert split_documents(docs[:1], 0.5, 0, "x") == {"train": docs[:1], "val": []}
    assert split_documents(docs, 0.0, 0, "x")["val"] == []


def test_corpus_documents_and_training_texts(tmp_path):
    cfg = small_config(tmp_path)
    docs = corpus_documents(cfg)
    assert set(docs) == {"shakespeare", "math", "notes"}
    for per in docs.values():
        assert per["train"] and per["val"] and set(per["train"]).isdisjoint(per["val"])
        assert all(len(d) <= cfg.doc_chars for d in per["train"] + per["val"])
    texts = tokenizer_training_texts(cfg, 20_000)
    val = {d for per in docs.values() for d in per["val"]}
    assert texts and not val & set(texts)
    assert 15_000 < sum(map(len, texts)) < 30_000


def test_tokenize_corpus_memo_and_disk_cache(tmp_path, monkeypatch):
    cfg = small_config(tmp_path, cache_dir=str(tmp_path / "cache"))
    tok = train_tokenizer(tokenizer_training_texts(cfg, 50_000), 700)
    monkeypatch.setattr(corpus_mod, "_MEMO", {})
    first = tokenize_corpus(cfg, tok)
    assert tokenize_corpus(cfg, tok) is first  # in-memory memo
    docs = corpus_documents(cfg)
    for name, per in docs.items():
        for split in ("train", "val"):
            td = first.docs[name][split]
            assert len(td) == len(per[split])
            assert tok.decode(td.doc(0).tolist()) == per[split][0]
    assert list((tmp_path / "cache").glob("tokens-*.npz"))
    monkeypatch.setattr(corpus_mod, "_MEMO", {})
    monkeypatch.setattr(type(tok), "encode_batch", lambda *a, **k: pytest.fail("cache miss"))
    cached = tokenize_corpus(cfg, tok)
    assert cached.key == first.key
    for name in docs:
        assert (cached.docs[name]["train"].tokens == first.docs[name]["train"].tokens).all()


@pytest.mark.slow
def test_default_corpus_documents():
    docs = corpus_documents(CorpusConfig())
    assert set(docs) == {"shakespeare", "python-stdlib", "math"}
    sizes = {name: sum(map(len, per["train"] + per["val"])) for name, per in docs.items()}
    assert sizes["shakespeare"] > 4_500_000
    assert 2_000_000 < sizes["python-stdlib"] <= 3_000_000
    assert sizes["math"] > 1_500_000
    for per in docs.values():
        assert 0.01 < len(per["val"]) / len(per["train"]) < 0.03


@pytest.mark.slow
def test_tokenizer_main_default_mixture(tmp_path):
    from openk2.cli.tokenizer import tokenizer_main
    from openk2.data.tokenizer import K2Tokenizer

    assert (
        tokenizer_main(["train", "--vocab-size", "4096", "--out", str(tmp_path), "--max-chars", "2000000"])
        == 0
    )
    tok = K2Tokenizer.load(tmp_path)
    assert tok.vocab_size == 4096 and tok.bos_id == 3840 and tok.pad_id == 4095
    for text in (
        "To be, or not to be",
        "def __init__(self):\n    return None\n",
        "Answer: 4738 + 2956 = 7694",
    ):
        assert tok.decode(tok.encode(text)) == text
        assert len(tok.encode(text)) < 0.7 * len(text)
