"""Segmenting documents for chunk-wise rewriting, and stitching the rewrites back."""

from __future__ import annotations

import random

import pytest

from openk2.data.chunking import split_segments, stitch, trailing_break

PROSE = (
    "The lighthouse stood on the northern cape. Its keeper climbed the stairs twice a day!\n\n"
    "In winter the lamp burned whale oil; in summer, rapeseed oil. Did it ever fail? Only once.\n"
    "A list line without a full stop\n\n\n"
    "The last paragraph is short."
)


def _random_text(rng: random.Random) -> str:
    words = ["alpha", "beta", "gamma", "delta", "x" * rng.randint(1, 40)]
    out = []
    for _ in range(rng.randint(0, 120)):
        out.append(rng.choice(words))
        out.append(rng.choice([" ", " ", " ", ". ", "! ", "\n", "\n\n", "; ", "  "]))
    return "".join(out)


@pytest.mark.parametrize("max_chars", [1, 7, 30, 64, 200, 10_000])
def test_no_text_is_lost_or_reordered(max_chars):
    rng = random.Random(max_chars)
    for text in [PROSE, "", "no boundary at all" * 20, *(_random_text(rng) for _ in range(50))]:
        segments = split_segments(text, max_chars)
        assert "".join(segments) == text
        assert all(0 < len(s) <= max_chars for s in segments)


def test_cuts_prefer_paragraphs_then_sentences():
    segments = split_segments(PROSE, 100)
    # every cut falls right after a paragraph break or a sentence end, never inside a sentence
    for seg in segments[:-1]:
        assert seg.endswith("\n\n") or seg.rstrip()[-1] in ".!?;:" or seg.endswith("\n"), repr(seg)
    assert segments[0] == "The lighthouse stood on the northern cape. Its keeper climbed the stairs twice a day!\n\n"


def test_a_long_sentence_is_cut_at_spaces_and_a_long_word_anywhere():
    sentence = "word " * 30  # 150 chars, no sentence end
    segments = split_segments(sentence, 40)
    assert all(s.endswith(" ") for s in segments[:-1])
    assert split_segments("y" * 95, 40) == ["y" * 40, "y" * 40, "y" * 15]


def test_short_text_is_one_segment_and_bad_size_is_an_error():
    assert split_segments("Short.", 100) == ["Short."]
    assert split_segments("", 100) == []
    with pytest.raises(ValueError, match="max_chars"):
        split_segments("text", 0)


def test_stitch_keeps_the_sources_breaks():
    sources = ["First part.\n\n", "Second part. ", "Third\n", "tail"]
    rewrites = [" One. ", "Two.", "Three.\n", "Four."]
    assert stitch(sources, rewrites) == "One.\n\nTwo. Three.\nFour."
    assert stitch(["a\n"], ["A"]) == "A\n"
    assert stitch(["abc", "def"], ["ABC", "DEF"]) == "ABC DEF"  # a cut inside a word still gets a space
    assert [trailing_break(s) for s in ("x\n \n", "x\n", "x ", "x")] == ["\n\n", "\n", " ", ""]
    with pytest.raises(ValueError, match="one rewrite per segment"):
        stitch(["a", "b"], ["A"])


def test_identity_rewrites_stitch_back_to_the_normalised_document():
    segments = split_segments(PROSE, 60)
    stitched = stitch(segments, segments)
    assert stitched.split() == PROSE.split()  # same words in the same order
    assert stitched.count("\n\n") == PROSE.count("\n\n")
