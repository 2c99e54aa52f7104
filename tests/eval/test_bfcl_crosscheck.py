"""BFCL's own checkers against openk2's diagnostic checker on a small seeded corpus of perturbed gold answers:
every disagreement is one of the documented differences, each of them occurs in the direction documented, and
every other perturbation class agrees."""

from __future__ import annotations

import pytest

pytest.importorskip("bfcl_eval")

from openk2.eval.bfcl_crosscheck import KNOWN, crosscheck, format_tables  # noqa: E402


@pytest.fixture(scope="module")
def result():
    return crosscheck(per_category=15, seed=0)


def test_every_disagreement_is_a_known_difference(result):
    assert "unexplained" not in result["reasons"], result["reasons"].get("unexplained")
    assert set(result["reasons"]) <= set(KNOWN)


@pytest.mark.parametrize(("cls", "direction"), [
    ("empty_optional_string", "BFCL only"),  # '' where '' is a possible answer: BFCL accepts
    ("int_as_float_in_array", "openk2 only"),  # [5.0] for integers: BFCL rejects, openk2 accepts
    ("dotted_name", "openk2 only"),  # math.factorial offered as math_factorial: openk2 maps it back
    ("unparsable_call", "BFCL only"),  # irrelevance: an undecodable call is no call to BFCL
])
def test_known_difference_classes_differ_as_documented(result, cls, direction):
    counts = result["single_turn"][cls]
    assert counts[direction] >= 3 and counts[direction] == sum(counts.values()), counts
    assert result["reasons"][cls][cls] == counts[direction]


def test_other_perturbations_agree(result):
    for group in ("single_turn", "multi_turn"):
        for cls, counts in result[group].items():
            if cls in KNOWN:
                continue
            disagreements = counts["BFCL only"] + counts["openk2 only"]
            explained = sum(by_class.get(cls, 0) for by_class in result["reasons"].values())
            assert disagreements == explained, (group, cls, counts)
    # both verdicts occur over the corpus, so agreement is not two checkers that always say the same
    single, multi = result["single_turn"], result["multi_turn"]
    assert single["gold"]["both pass"] > 0 and single["wrong_value"]["both fail"] == sum(
        single["wrong_value"].values())
    assert multi["gold"]["both pass"] == sum(multi["gold"].values())
    assert multi["call_dropped"]["both fail"] == sum(multi["call_dropped"].values())
    assert multi["calls_reversed"]["both pass"] > 0 and multi["calls_reversed"]["both fail"] > 0


def test_tables_render(result):
    text = format_tables(result)
    assert "| gold |" in text and "disagreements by reason" in text and "(known)" in text
