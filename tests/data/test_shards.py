"""Tests for token shards: the writer (resumable, fingerprinted) and the streaming, rank-sharded loader."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from openk2.data import shards as shards_mod
from openk2.data.corpus import CorpusConfig, tokenizer_training_texts
from openk2.data.loader import PackedLoader
from openk2.data.shard_docs import ShardDocs, open_shards
from openk2.data.shards import read_manifest, source_dir, write_shards
from openk2.data.sources import SourceConfig
from openk2.data.tokenizer import train_tokenizer
from openk2.data.unigram import unigram_baseline


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shards")
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
    sharded = dataclasses.replace(cfg, shard_dir=str(tmp / "shards"))
    write_shards(sharded, tok, shard_tokens=5000)  # many small shards
    return cfg, sharded, tok


def take(loader, n):
    return [b for _, b in zip(range(n), loader, strict=False)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_shards_hold_the_in_ram_tokens(setup):
    cfg, sharded, tok = setup
    ram, mapped = PackedLoader(cfg, tok, 2).corpus, open_shards(sharded, tok)
    for name, per in ram.docs.items():
        for split, docs in per.items():
            other = mapped.docs[name][split]
            assert len(other) == len(docs) and other.num_tokens == docs.num_tokens
            assert all(np.array_equal(other.doc(i), docs.doc(i)) for i in range(len(docs)))
            assert np.array_equal(other.token_counts(tok.vocab_size), docs.token_counts(tok.vocab_size))
    manifest = read_manifest(source_dir(sharded.shard_dir, sharded, sharded.sources[0], tok))
    assert manifest["dtype"] == "uint16" and len(manifest["splits"]["train"]["shards"]) > 5


def test_sharded_loader_equals_in_ram_loader(setup):
    cfg, sharded, tok = setup
    assert_same(take(PackedLoader(cfg, tok, 4), 80), take(PackedLoader(sharded, tok, 4), 80))
    assert_same(list(PackedLoader(cfg, tok, 3, split="val", loop=False)),
                list(PackedLoader(sharded, tok, 3, split="val", loop=False)))
    assert unigram_baseline(PackedLoader(sharded, tok, 2)) == pytest.approx(
        unigram_baseline(PackedLoader(cfg, tok, 2)), rel=1e-12)


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_data_rank_gets_and_reads_only_its_rows(setup, monkeypatch, ranks):
    _, sharded, tok = setup
    batches = 25
    whole = take(PackedLoader(sharded, tok, 8), batches)
    read: dict[int, int] = {}
    original = ShardDocs.doc

    def counting_doc(self, i):
        read[current] = read.get(current, 0) + 1
        return original(self, i)

    monkeypatch.setattr(ShardDocs, "doc", counting_doc)
    parts = []
    for current in range(ranks):
        parts.append(take(PackedLoader(sharded, tok, 8, data_rank=current, num_data_ranks=ranks), batches))
    for i in range(batches):
        for key in whole[i]:
            assert torch.equal(torch.cat([p[i][key] for p in parts]), whole[i][key])
    read[-1] = 0
    current = -1
    take(PackedLoader(sharded, tok, 8), batches)
    for r in range(ranks):  # each rank reads about 1/ranks of the documents (plus the ones it shares)
        assert read[r] < read[-1] / ranks * 1.5, (read, ranks)


def test_resume_is_exact_and_layout_free(setup):
    _, sharded, tok = setup
    reference = take(PackedLoader(sharded, tok, 4, data_rank=1, num_data_ranks=2), 60)
    first = PackedLoader(sharded, tok, 4, data_rank=1, num_data_ranks=2)
    take(first, 23)
    state = json.loads(json.dumps(first.state_dict()))
    assert len(json.dumps(state)) < 2000  # a position, not buffered tokens
    resumed = PackedLoader(sharded, tok, 4, data_rank=1, num_data_ranks=2)
    resumed.load_state_dict(state)
    assert_same(reference[23:], take(resumed, 37))
    assert resumed.epochs["notes"] >= 1
    # The position is global: a single-rank loader resumed from rank 1's state yields the whole batches.
    single = PackedLoader(sharded, tok, 4)
    single.load_state_dict(state)
    nxt = next(single)
    assert torch.equal(nxt["input_ids"][2:], reference[23]["input_ids"])


def test_writer_resumes_after_a_kill(setup, tmp_path, monkeypatch):
    _, sharded, tok = setup
    cfg = dataclasses.replace(sharded, shard_dir=str(tmp_path / "a"))
    flush, calls = shards_mod._flush, []

    def dying_flush(*args):
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed while writing the fourth shard
        calls.append(args[2])
        return flush(*args)

    monkeypatch.setattr(shards_mod, "_flush", dying_flush)
    with pytest.raises(KeyboardInterrupt):
        write_shards(cfg, tok, shard_tokens=5000)
    directory = source_dir(cfg.shard_dir, cfg, cfg.sources[0], tok)
    assert read_manifest(directory) is None
    (directory / "train-00003.bin").write_bytes(b"half a shard")  # a shard whose .idx never landed
    (directory / "train-00003.idx.tmp999").write_bytes(b"half an index")  # a rename that never happened
    kept = {p.name: p.stat().st_mtime_ns for p in directory.glob("train-0000[012].*")}
    assert len(kept) == 6
    monkeypatch.setattr(shards_mod, "_flush", flush)
    encoded = []
    real_encode = type(tok).encode_batch
    monkeypatch.setattr(type(tok), "encode_batch", lambda self, texts, *a: encoded.append(len(texts))
                        or real_encode(self, texts, *a))
    reports = write_shards(cfg, tok, shard_tokens=5000)
    assert reports[0].kept == 3 and reports[0].written > 0 and not reports[0].skipped
    assert {p.name: p.stat().st_mtime_ns for p in directory.glob("train-0000[012].*")} == kept
    skipped = sum(s["docs"] for s in read_manifest(directory)["splits"]["train"]["shards"][:3])
    every = sum(read_manifest(r.directory)["splits"][s]["docs"] for r in reports for s in ("train", "val"))
    assert sum(encoded) == every - skipped  # the kept shards' documents were not tokenised again
    fresh = source_dir(sharded.shard_dir, sharded, sharded.sources[0], tok)
    for f in sorted(fresh.glob("*.bin")) + sorted(fresh.glob("*.idx")):
        assert (directory / f.name).read_bytes() == f.read_bytes()
    assert not list(directory.glob("*.tmp*"))
    encoded.clear()
    assert all(r.skipped for r in write_shards(cfg, tok, shard_tokens=5000)) and not encoded  # done: unread


def test_fingerprint_follows_tokenizer_and_files(setup, tmp_path):
    cfg, _, tok = setup
    notes = tmp_path / "n.jsonl"
    notes.write_text("".join(json.dumps({"text": f"line {i} " * 5}) + "\n" for i in range(30)))
    small = CorpusConfig(sources=[SourceConfig(kind="jsonl", name="n", path=str(notes))], seq_len=16,
                         val_fraction=0.1, shard_dir=str(tmp_path / "s"))
    before = source_dir(small.shard_dir, small, small.sources[0], tok)
    first = next(PackedLoader(small, tok, 2))  # written lazily on first use
    assert read_manifest(before) is not None
    notes.write_text("".join(json.dumps({"text": f"other {i} " * 5}) + "\n" for i in range(31)))
    after = source_dir(small.shard_dir, small, small.sources[0], tok)
    assert after != before
    with pytest.raises(ValueError, match="openk2 data tokenize"):
        open_shards(small, tok)
    second = next(PackedLoader(small, tok, 2))
    assert not torch.equal(first["input_ids"], second["input_ids"])
    other_tok = train_tokenizer(tokenizer_training_texts(cfg, 50_000), 700)
    assert source_dir(small.shard_dir, small, small.sources[0], other_tok) != after
    with pytest.raises(ValueError, match="data ranks"):
        PackedLoader(small, tok, 3, num_data_ranks=2)


def test_data_tokenize_command(setup, tmp_path, capsys):
    from openk2.cli import main

    _, _, tok = setup
    tok.save(tmp_path / "tok")
    run = tmp_path / "run.toml"
    run.write_text(f'[tokenizer]\npath = "{tmp_path / "tok"}"\n[data]\nseq_len = 16\nval_fraction = 0.1\n'
                   '[[data.sources]]\nkind = "math"\nnum_docs = 200\n')
    assert main(["data", "tokenize", "--config", str(run), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "math: 2 shards written, 0 kept; train 180 docs" in out and "val 20 docs" in out
    assert main(["data", "tokenize", "--config", str(run), "--out", str(tmp_path / "out")]) == 0
    assert "math: up to date" in capsys.readouterr().out
    cfg = CorpusConfig.from_dict({"seq_len": 16, "val_fraction": 0.1, "shard_dir": str(tmp_path / "out"),
                                  "sources": [{"kind": "math", "num_docs": 200}]})
    assert len(open_shards(cfg, tok).docs["math"]["train"]) == 180
    run.write_text(run.read_text().replace(f'path = "{tmp_path / "tok"}"', 'train_chars = 1000'))
    assert main(["data", "tokenize", "--config", str(run), "--out", str(tmp_path / "out")]) == 2
    assert "a tokenizer is needed" in capsys.readouterr().err


_MEASURE = """
import json, sys
import numpy as np
from openk2.data.corpus import CorpusConfig
from openk2.data.loader import PackedLoader
from openk2.data.tokenizer import K2Tokenizer

def rss():
    fields = {}
    for line in open("/proc/self/status").read().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields

cfg = CorpusConfig.from_dict(json.loads(sys.argv[1]))
loader = PackedLoader(cfg, K2Tokenizer.load(sys.argv[2]), 8)
next(loader)
before = rss()
docs = loader.corpus.docs["big"]["train"]
peak = dict(before)
for i in range((docs.num_tokens + len(docs)) // (8 * 255) if sys.argv[3] == "stream" else 0):
    next(loader)
    if i % 20 == 0:
        peak = {k: max(peak[k], v) for k, v in rss().items()}
held = [docs.doc(i).astype(np.int32) for i in range(len(docs))] if sys.argv[3] == "hold" else []
print(json.dumps({"growth": {k: peak[k] - before[k] for k in peak}, "epochs": loader.epochs["big"],
                  "before": before,
                  "tokens": docs.num_tokens, "held": rss()["RssAnon"] - before["RssAnon"]}))
"""


def _measure(cfg: CorpusConfig, tok_dir, mode: str) -> dict:
    cmd = [sys.executable, "-c", _MEASURE, json.dumps(cfg.to_dict()), str(tok_dir), mode]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


@pytest.mark.slow
def test_streaming_memory_does_not_grow_with_the_corpus(setup, tmp_path):
    """A fresh process iterates one epoch of ~2.5M tokens of shards; its RSS stays flat (the heap of a process
    that tokenised before would hide new allocations, so this one never tokenises)."""
    _, _, tok = setup
    tok.save(tmp_path / "tok")
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), size=rng.integers(2, 8))) for _ in range(2000)]
    with (tmp_path / "big.jsonl").open("w") as fh:
        for _ in range(1500):  # ~3 MB of text
            fh.write(json.dumps({"text": " ".join(rng.choice(words, size=400))}) + "\n")
    cfg = CorpusConfig(sources=[SourceConfig(kind="jsonl", name="big", path=str(tmp_path / "big.jsonl"))],
                       seq_len=256, val_fraction=0.01, shard_dir=str(tmp_path / "s"))
    write_shards(cfg, tok, shard_tokens=1 << 18)
    streamed = _measure(cfg, tmp_path / "tok", "stream")
    assert streamed["epochs"] == 1 and streamed["tokens"] > 1_000_000  # every document was read once
    token_bytes = 4 * streamed["tokens"]  # what the in-RAM corpus holds (int32)
    assert streamed["growth"]["VmRSS"] < token_bytes / 10, streamed
    # The meter does see a corpus-sized allocation: the same tokens held in RAM, as the in-RAM loader does.
    assert _measure(cfg, tmp_path / "tok", "hold")["held"] > token_bytes / 2


def test_data_tokenize_bad_input_is_one_line(setup, tmp_path, capsys):
    from openk2.cli import main

    setup[2].save(tmp_path / "tok")
    run = tmp_path / "run.toml"
    run.write_text('[data]\n[[data.sources]]\nkind = "math"\nnum_docs = 20\n')
    assert main(["data", "tokenize", "--config", str(run), "--set", "data.shard_dirs=x"]) == 2
    assert "unknown key(s) in [data]: shard_dirs" in capsys.readouterr().err
    assert main(["data", "tokenize", "--config", str(run), "--tokenizer", str(tmp_path / "tok")]) == 2
    assert "no shard directory: pass --out DIR" in capsys.readouterr().err
    assert main(["data", "tokenize", "--config", str(run), "--out", str(tmp_path / "o"), "--shard-tokens", "0",
                 "--tokenizer", str(tmp_path / "tok")]) == 2
    assert "shard_tokens must be positive" in capsys.readouterr().err
    assert main(["data", "tokenize", "--config", str(run), "--out", str(tmp_path / "o"),
                 "--tokenizer", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
