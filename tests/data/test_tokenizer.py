"""Tests for the byte-level BPE tokenizer with K2 special tokens and the tiktoken loader."""

import base64
import json

import pytest

from openk2.data.tokenizer import (
    K2_SPECIAL_OFFSETS,
    K2_SPECIAL_TOKENS,
    K2Tokenizer,
    read_tiktoken_ranks,
    special_block,
    train_tokenizer,
)

SAMPLE = [
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "def add(a: int, b: int) -> int:\n    return a + b\n\n\nclass Foo:\n    pass\n",
    "Problem: 4738 + 2956 = ?\nAnswer: 4738 + 2956 = 7694\n",
    "Unicode: café naïve Ωμέγα 你好世界 🚀 — ok\n",
] * 50

ROUND_TRIP = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\n",
    "def f(x):\n\treturn {'a': [1, 2, 3]}  # comment\n",
    "café naïve Ωμέγα 你好世界 🚀 \u200b zero-width",
    "numbers 1234567890 3.14159 -42",
    "rare bytes: \x00\x01\x7f ÿ",
]


@pytest.fixture(scope="module")
def tok() -> K2Tokenizer:
    return train_tokenizer(SAMPLE, vocab_size=600)


def test_vocab_size_and_layout(tok):
    assert tok.vocab_size == 600
    base = tok.num_base_tokens
    assert base == 600 - 256
    # Same offsets inside the special block as the released K2 tokenizer (163584 + offset).
    for name, offset in K2_SPECIAL_OFFSETS.items():
        assert tok.special_ids[name] == base + offset
    assert tok.special_ids["[UNK]"] == 598 and tok.special_ids["[PAD]"] == 599
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (base, base + 1, 599)
    assert set(tok.special_ids) == set(K2_SPECIAL_TOKENS)


def test_k2_layout_matches_released_ids():
    names = special_block(163584, 256)
    ids = {n: 163584 + i for i, n in enumerate(names)}
    assert ids["[BOS]"] == 163584 and ids["<|im_middle|>"] == 163601
    assert ids["[UNK]"] == 163838 and ids["[PAD]"] == 163839
    assert names[5] == "<|reserved_token_163589|>"


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_bpe_compresses(tok):
    text = SAMPLE[0]
    assert len(tok.encode(text)) < len(text.encode()) / 2


@pytest.mark.parametrize("name", K2_SPECIAL_TOKENS)
def test_special_tokens_single_id(tok, name):
    assert tok.encode(name, allow_special=True) == [tok.special_ids[name]]
    assert tok.decode([tok.special_ids[name]]) == name


def test_plain_text_never_yields_special_ids(tok):
    text = "<|im_user|>hi[EOS]<|im_end|>[BOS] <|reserved_token_350|>"
    ids = tok.encode(text)
    assert all(i < tok.num_base_tokens for i in ids)
    assert tok.decode(ids) == text
    mixed = tok.encode(text, allow_special=True)
    assert tok.special_ids["<|im_user|>"] in mixed and tok.special_ids["[EOS]"] in mixed


def test_encode_batch_matches_encode(tok):
    assert tok.encode_batch(ROUND_TRIP) == [tok.encode(t) for t in ROUND_TRIP]


def test_save_load(tok, tmp_path):
    tok.save(tmp_path / "tk")
    cfg = json.loads((tmp_path / "tk" / "tokenizer_config.json").read_text())
    assert cfg["eos_token_id"] == tok.eos_id and cfg["special_tokens"]["<|im_assistant|>"] == tok.bos_id + 4
    for loaded in (K2Tokenizer.load(tmp_path / "tk"), K2Tokenizer.load(tmp_path / "tk" / "tokenizer.json")):
        assert loaded.special_ids == tok.special_ids and loaded.vocab_size == tok.vocab_size
        for text in ROUND_TRIP:
            assert loaded.encode(text) == tok.encode(text)
        assert loaded.fingerprint == tok.fingerprint


def test_small_corpus_grows_special_block():
    small = train_tokenizer(["abc abc"], vocab_size=600)
    assert small.vocab_size == 600 and small.special_ids["[PAD]"] == 599
    assert small.special_ids["[BOS]"] == small.num_base_tokens < 600 - 256


def test_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(SAMPLE, vocab_size=300)
    with pytest.raises(ValueError, match="num_special"):
        train_tokenizer(SAMPLE, vocab_size=600, num_special=5)


def test_decode_out_of_range(tok):
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


# --- tiktoken ---------------------------------------------------------------------------------


def _byte_decoder() -> dict[str, int]:
    # GPT-2 byte-level mapping: printable bytes stand for themselves, the rest move to U+0100 and up.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def write_ranks(tok: K2Tokenizer, path) -> int:
    """Write the BPE part of `tok` as a tiktoken ranks file (rank = id, i.e. merge order)."""
    vocab = json.loads(tok._backend.tok.to_str())["model"]["vocab"]
    dec = _byte_decoder()
    lines = [f"{base64.b64encode(bytes(dec[c] for c in t)).decode()} {i}" for t, i in vocab.items()]
    path.write_text("\n".join(lines) + "\n")
    return len(vocab)


def test_read_ranks_errors(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_text("QQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=":2:"):
        read_tiktoken_ranks(bad)


def test_from_tiktoken(tok, tmp_path):
    pytest.importorskip("tiktoken")
    path = tmp_path / "tiktoken.model"
    n = write_ranks(tok, path)
    tt = K2Tokenizer.from_tiktoken(path)
    # K2 layout: 256 special slots right after the ranks.
    assert tt.vocab_size == n + 256
    assert tt.bos_id == n and tt.eos_id == n + 1 and tt.special_ids["<|im_middle|>"] == n + 17
    assert tt.special_ids["[PAD]"] == n + 255
    for text in ROUND_TRIP:
        assert tt.decode(tt.encode(text)) == text
    for name in K2_SPECIAL_TOKENS:
        assert tt.encode(name, allow_special=True) == [tt.special_ids[name]]
    assert all(i < n for i in tt.encode("<|im_end|>[EOS]"))
    # Rank-based merging reproduces the trained BPE on ordinary text.
    assert tt.encode(SAMPLE[0]) == tok.encode(SAMPLE[0])
    assert tt.encode_batch(ROUND_TRIP) == [tt.encode(t) for t in ROUND_TRIP]
    tt.save(tmp_path / "saved")
    again = K2Tokenizer.load(tmp_path / "saved")
    assert again.special_ids == tt.special_ids and again.encode(SAMPLE[1]) == tt.encode(SAMPLE[1])


def test_from_tiktoken_custom_specials(tok, tmp_path):
    pytest.importorskip("tiktoken")
    path = tmp_path / "tiktoken.model"
    n = write_ranks(tok, path)
    specials = {name: n + i for i, name in enumerate(K2_SPECIAL_TOKENS)}
    tt = K2Tokenizer.from_tiktoken(path, special_tokens=specials)
    assert tt.special_ids == specials and tt.vocab_size == n + len(K2_SPECIAL_TOKENS)
    with pytest.raises(ValueError, match="collide"):
        K2Tokenizer.from_tiktoken(path, special_tokens={**specials, "[BOS]": 5})


def test_from_tiktoken_without_package(tok, tmp_path, monkeypatch):
    path = tmp_path / "tiktoken.model"
    write_ranks(tok, path)
    import builtins

    real_import = builtins.__import__

    def no_tiktoken(name, *args, **kwargs):
        if name == "tiktoken":
            raise ImportError("no tiktoken")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tiktoken)
    with pytest.raises(ImportError, match="pip install tiktoken"):
        K2Tokenizer.from_tiktoken(path)


def test_tokenizer_main(tmp_path, monkeypatch, capsys):
    toml = tmp_path / "data.toml"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(" ".join(SAMPLE))
    toml.write_text(f'[data]\nsources = [{{kind = "text", path = "{tmp_path / "docs"}"}}]\n')
    from openk2.cli.tokenizer import tokenizer_main

    rc = tokenizer_main(
        ["train", "--vocab-size", "700", "--out", str(tmp_path / "out"), "--corpus-config", str(toml)]
    )
    assert rc == 0
    loaded = K2Tokenizer.load(tmp_path / "out")
    assert loaded.vocab_size == 700 and "trained vocab 700" in capsys.readouterr().out
