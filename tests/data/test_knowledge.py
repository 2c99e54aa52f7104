"""The synthetic knowledge corpus: deterministic, checkable, and the probe's wording kept out of training text."""

from __future__ import annotations

from openk2.data.knowledge import (
    ATTRIBUTES,
    POOLS,
    QUESTIONS,
    cloze_items,
    fact_recall,
    make_entities,
    paraphrase,
    qa_items,
    raw_document,
)


def test_entities_are_deterministic_unique_and_draw_from_the_pools():
    a, b = make_entities(300, seed=3), make_entities(300, seed=3)
    assert a == b
    assert make_entities(300, seed=4) != a
    assert len({e.name for e in a}) == 300
    for e in a:
        assert set(e.facts) == set(ATTRIBUTES)
        assert all(e.facts[k] in POOLS[k] for k in ATTRIBUTES)
    # uniform pools: no value dominates, so knowing the pool alone gives about chance accuracy
    towns = [e.facts["town"] for e in a]
    assert max(towns.count(t) for t in POOLS["town"]) < 0.15 * len(a)


def test_every_document_states_every_fact():
    for e in make_entities(50, seed=1):
        assert fact_recall(raw_document(e), e) == 1.0
        copies = [paraphrase(e, k, seed=1) for k in range(10)]
        assert all(fact_recall(c, e) == 1.0 for c in copies)
        assert all(e.name.split()[0] in c for c in copies)
        assert len(set(copies)) == 10  # ten different rephrasings
        assert raw_document(e) not in copies


def test_probe_questions_never_appear_in_training_text():
    entities = make_entities(40, seed=2)
    texts = [raw_document(e) for e in entities] + [paraphrase(e, k, 2) for e in entities for k in range(10)]
    stems = [q.split("{name}")[0] for q in QUESTIONS.values()]
    assert not any(stem in t for stem in stems for t in texts)
    assert not any("Question:" in t or "Answer:" in t for t in texts)


def test_qa_and_cloze_items_point_at_the_right_answer():
    entities = make_entities(5, seed=0)
    qa, cloze = qa_items(entities), cloze_items(entities)
    assert len(qa) == len(cloze) == 5 * len(ATTRIBUTES)
    for item in qa + cloze:
        e = next(x for x in entities if x.name == item.entity)
        assert item.answer == e.facts[item.attribute] and item.answer in item.candidates
        assert e.name in item.prompt
    # the cloze prompt followed by the answer is the raw sentence itself
    e = entities[0]
    town_item = next(i for i in cloze if i.entity == e.name and i.attribute == "town")
    assert f"{town_item.prompt} {town_item.answer}." in raw_document(e)
