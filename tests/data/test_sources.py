"""Tests for corpus sources: bundled Shakespeare and stdlib, user text/JSONL/Parquet files."""

import json
import sysconfig

import pytest

from openk2.data.sources import SourceConfig, read_documents, shakespeare_documents, strip_gutenberg


def test_shakespeare_plays_without_boilerplate():
    docs = list(shakespeare_documents())
    assert len(docs) == 42
    assert sum(map(len, docs)) > 4_000_000
    text = "\n".join(docs)
    assert "HAMLET" in text and "To be, or not to be" in text
    for marker in ("Project Gutenberg", "*** START OF", "*** END OF", "SMALL PRINT", "\r"):
        assert marker not in text


def test_strip_gutenberg():
    raw = (
        "The Project Gutenberg EBook of Hamlet\nLicence blah\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\n"
        "ACT I.\nWho's there?\n\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nMore licence\n"
    )
    assert strip_gutenberg(raw) == "ACT I.\nWho's there?\n"
    old = "header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*\nBody.\nEnd of Project Gutenberg's X\n"
    assert strip_gutenberg(old) == "Body.\n"
    assert strip_gutenberg("plain text\n") == "plain text\n"


def test_stdlib_code_sorted_and_capped():
    docs = read_documents(SourceConfig(kind="python-stdlib", max_chars=300_000))
    assert 0 < sum(map(len, docs)) <= 300_000
    assert any("def " in d for d in docs) and any("import " in d for d in docs)
    assert docs == read_documents(SourceConfig(kind="python-stdlib", max_chars=300_000))


def test_stdlib_skips_tests(monkeypatch, tmp_path):
    for rel in ("a.py", "pkg/b.py", "test/t.py", "pkg/tests/t.py", "idlelib/i.py", "site-packages/s.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert read_documents(SourceConfig(kind="python-stdlib")) == ["# a.py\n", "# pkg/b.py\n"]


def test_text_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second\r\n")
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "skip.md").write_text("not text")
    src = SourceConfig(kind="text", path=str(tmp_path))
    assert read_documents(src) == ["first", "second\n", "third"]
    assert read_documents(SourceConfig(kind="text", path=str(tmp_path / "a.txt"))) == ["first"]


def test_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n{"body": "three", "text": "x"}\n')
    assert read_documents(SourceConfig(kind="jsonl", path=str(path))) == ["one", "two", "x"]
    path.write_text('{"body": "one"}\n{"body": "two"}\n')
    assert read_documents(SourceConfig(kind="jsonl", path=str(path), field="body")) == ["one", "two"]
    path.write_text('{"body": "one"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:1: .*'text'"):
        read_documents(SourceConfig(kind="jsonl", path=str(path)))
    path.write_text("{oops\n")
    with pytest.raises(ValueError, match="invalid JSON"):
        read_documents(SourceConfig(kind="jsonl", path=str(path)))


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["alpha", None, "beta"]}), tmp_path / "d.parquet")
    src = SourceConfig(kind="parquet", path=str(tmp_path), field="content")
    assert read_documents(src) == ["alpha", "beta"]
    with pytest.raises(ValueError, match="no column 'text'"):
        read_documents(SourceConfig(kind="parquet", path=str(tmp_path)))


def test_max_chars_cap(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * 10}) + "\n" for _ in range(10)))
    assert read_documents(SourceConfig(kind="jsonl", path=str(path), max_chars=35)) == ["x" * 10] * 3 + [
        "x" * 5
    ]
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"line {i}\n" for i in range(100)))
    (capped,) = read_documents(SourceConfig(kind="text", path=str(lines), max_chars=30))
    assert capped == "line 0\nline 1\nline 2\nline 3\n"


def test_shakespeare_cap():
    docs = read_documents(SourceConfig(kind="shakespeare", max_chars=50_000))
    assert len(docs) == 1 and 49_000 < len(docs[0]) <= 50_000 and docs[0].endswith("\n")


def test_bad_source_configs(tmp_path):
    with pytest.raises(ValueError, match="unknown source kind"):
        SourceConfig(kind="wikipedia")
    with pytest.raises(ValueError, match="needs a path"):
        SourceConfig(kind="jsonl")
    with pytest.raises(ValueError, match="weight"):
        SourceConfig(kind="math", weight=-1)
    with pytest.raises(ValueError, match=r"unknown source config keys \['colour'\]"):
        SourceConfig.from_dict({"kind": "math", "colour": "red"})
    with pytest.raises(ValueError, match="does not exist"):
        read_documents(SourceConfig(kind="text", path=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="no \\*.txt files"):
        read_documents(SourceConfig(kind="text", path=str(tmp_path)))
