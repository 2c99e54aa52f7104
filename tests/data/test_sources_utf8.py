"""File-reading errors name the file: invalid UTF-8 or a broken Parquet file in a corpus source, a run file, a
rephrase input, a style file or a tool repository is a ValueError (or a per-record reject) saying which file
(and line), not a bare UnicodeDecodeError."""

from __future__ import annotations

import json

import pytest

from openk2.configfile import read_toml
from openk2.data.sources import SourceConfig, read_documents

BAD = b"caf\xe9 au lait\n"  # Latin-1, not UTF-8


def test_jsonl_source_names_the_file_and_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(json.dumps({"text": "fine"}).encode() + b"\n" + b'{"text": "' + BAD.strip() + b'"}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not valid UTF-8 \(byte 0xe9 at offset 13"):
        read_documents(SourceConfig(kind="jsonl", path=str(path)))


def test_text_source_names_the_file(tmp_path):
    (tmp_path / "a.txt").write_text("good text\n")
    (tmp_path / "b.txt").write_bytes(BAD)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'b.txt'}: not valid UTF-8.*iconv"):
        read_documents(SourceConfig(kind="text", path=str(tmp_path)))
    (tmp_path / "b.txt").write_text("caf\u00e9\r\nau lait\n")  # valid UTF-8 reads, line endings normalised
    assert read_documents(SourceConfig(kind="text", path=str(tmp_path))) == ["good text\n", "caf\u00e9\nau lait\n"]


def test_broken_parquet_source_names_the_file(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=rf"{path}: not a readable Parquet file"):
        read_documents(SourceConfig(kind="parquet", path=str(path)))


def test_run_file_with_invalid_utf8_names_the_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"[train]\nname = \"" + BAD.strip() + b"\"\n")
    with pytest.raises(ValueError, match=rf"{path} is not valid UTF-8"):
        read_toml(path)


def test_rephrase_input_with_invalid_utf8_is_a_bad_record_naming_shard_and_line(tmp_path):
    from openk2.rephrase.rephraser import read_records

    path = tmp_path / "shard.jsonl"
    path.write_bytes(json.dumps({"id": "a", "text": "ok"}).encode() + b"\n" + BAD)
    good, bad = list(read_records(path))
    assert good.text == "ok" and bad.text is None and (bad.shard, bad.line) == ("shard", 2)
    assert bad.problem.startswith("not valid UTF-8")


def test_style_file_and_tool_repository_name_the_file(tmp_path):
    from openk2.agentic.tools import read_tools
    from openk2.rephrase.prompts import load_styles

    styles = tmp_path / "styles.json"
    styles.write_bytes(b'{"x": {"instruction": "' + BAD.strip() + b'"}}')
    with pytest.raises(ValueError, match=rf"{styles}: not valid UTF-8"):
        load_styles(styles)
    tools = tmp_path / "tools.jsonl"
    tools.write_bytes(BAD)
    with pytest.raises(ValueError, match=rf"{tools}: not valid UTF-8"):
        read_tools(tools)
