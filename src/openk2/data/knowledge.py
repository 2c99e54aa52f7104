"""A synthetic knowledge corpus: invented people with checkable facts, a QA probe, and a template paraphraser.

Every entity has a generated name (random syllables, so no model has seen it) and five categorical facts drawn
uniformly from fixed pools: home town, trade, instrument, founded society and companion animal. Because the
pools are uniform, knowing the pool gives chance accuracy (1 / pool size) and anything above it is memorised
knowledge.

- `raw_document(entity)`: the corpus text, one fixed template ("X was born in Y. X worked as a Z. ...").
- `paraphrase(entity, copy, seed)`: a programmatic rephrasing, the stand-in for an LLM when the local one is
  too weak to keep facts (see docs/rephrase.md): a style from the prompt bank's names (encyclopedic,
  conversational, qa, textbook, child, critic), sentence order shuffled, and for each fact one of several
  wordings. Its wordings never use the probe's question templates.
- `qa_items(entities)`: the probe. Each item has a question prompt, the right answer and the candidate pool;
  a model answers by ranking the candidates by log-likelihood (see `openk2.experiments.rephrase_vs_repeat`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "k", "kl", "l", "m", "n", "p", "qu", "r", "s", "st", "t", "th",
          "tr", "v", "vr", "z", "zh")
VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou")
CODAS = ("", "", "n", "r", "l", "s", "th", "x", "m", "nd")

# Fact pools; every value starts with a consonant so "a {value}" always reads well.
POOLS: dict[str, tuple[str, ...]] = {
    "town": ("Tharnley", "Vossmere", "Quillhaven", "Dunbrake", "Orlesk", "Marrowfield", "Kestrin", "Belvatch",
             "Hollowmere", "Saltbridge", "Wendrith", "Carrowby", "Yarlstone", "Fenmouth", "Pellidge", "Grimsvale"),
    "trade": ("glassblower", "cartographer", "beekeeper", "clockmaker", "bookbinder", "ropemaker", "tanner",
              "lamplighter", "stonemason", "weaver", "falconer", "potter", "vintner", "cooper", "locksmith",
              "dyer"),
    "instrument": ("lute", "oboe", "harp", "viola", "zither", "bagpipe", "cello", "dulcimer", "flute",
                   "mandolin", "tuba", "banjo", "sitar", "trumpet", "piccolo", "fiddle"),
    "society": ("Lantern Circle", "Copper Guild", "Ember League", "Silt Society", "Heron Club", "Fern Order",
                "Marble Union", "Thistle Lodge", "Cobalt Fellowship", "Willow Council", "Granite Assembly",
                "Saffron Brotherhood", "Mist Collective", "Ivory Chapter", "Tidal Academy", "Bramble Guild"),
    "animal": ("heron", "ferret", "tortoise", "raven", "goat", "lynx", "parrot", "badger", "hare", "magpie",
               "pony", "stoat", "gecko", "peacock", "mule", "salamander"),
}
ATTRIBUTES = tuple(POOLS)

# The raw corpus: one wording per fact, always in this order.
RAW_TEMPLATES = {
    "town": "{name} was born in {town}.",
    "trade": "{name} worked as a {trade}.",
    "instrument": "{name} played the {instrument}.",
    "society": "{name} founded the {society}.",
    "animal": "{name} kept a {animal}.",
}

# The probe: question prompts (answer = " " + value) never used by the raw text or the paraphraser.
QUESTIONS = {
    "town": "Question: In which town was {name} born?\nAnswer:",
    "trade": "Question: What was the trade of {name}?\nAnswer: a",
    "instrument": "Question: Which instrument did {name} play?\nAnswer: the",
    "society": "Question: Which society did {name} found?\nAnswer: the",
    "animal": "Question: What animal did {name} keep?\nAnswer: a",
}

# Paraphraser wordings, about as long as the raw sentence each (so arms at equal tokens see facts equally often);
# {who} is the full name or the surname alone.
WORDINGS = {
    "town": ("{who} came from {town}.", "{town} was the birthplace of {who}.", "{who} was a native of {town}.",
             "{who}, born in {town}.", "{who} was from {town}."),
    "trade": ("{who} was a {trade}.", "By trade, {who} was a {trade}.", "{who} made a living as a {trade}.",
              "{who} earned a wage as a {trade}.", "The trade of {who}: {trade}."),
    "instrument": ("{who} played a {instrument}.", "The {instrument} was the instrument of {who}.",
                   "{who} made music on the {instrument}.", "{who} was a {instrument} player.",
                   "{who} loved the {instrument}."),
    "society": ("{who} started the {society}.", "The {society} was set up by {who}.",
                "{who} established the {society}.", "The founder of the {society} was {who}.",
                "{who} created the {society}."),
    "animal": ("{who} had a pet {animal}.", "A {animal} lived with {who}.", "{who} looked after a {animal}.",
               "{who} owned a {animal}.", "The pet of {who} was a {animal}."),
}

# Per-style opening line, short for the same reason (names match the rephrasing prompt bank).
STYLE_FRAMES = {
    "encyclopedic": "From the archive.",
    "conversational": "Guess what.",
    "qa": "",  # built from question/answer pairs instead
    "textbook": "Lesson.",
    "child": "A story.",
    "critic": "A review.",
}
PARAPHRASE_STYLES = tuple(STYLE_FRAMES)

# Q&A-style paraphrases ask differently from the probe (no "Question:/Answer:" lines, other wordings).
QA_STYLE = {
    "town": ("Where was {name} from?", "{town}."),
    "trade": ("The job of {name}?", "A {trade}."),
    "instrument": ("Music by {name}?", "On the {instrument}."),
    "society": ("What did {name} start?", "The {society}."),
    "animal": ("A pet of {name}?", "A {animal}."),
}


@dataclass(frozen=True)
class Entity:
    """An invented person and their facts (attribute -> value from POOLS)."""

    name: str
    facts: dict[str, str]


@dataclass(frozen=True)
class QAItem:
    """One probe question: the prompt, the correct value and every candidate value (the attribute's pool)."""

    entity: str
    attribute: str
    prompt: str
    answer: str
    candidates: tuple[str, ...]


def make_entities(count: int, seed: int = 0) -> list[Entity]:
    """`count` entities with unique invented names and uniformly drawn facts, the same for the same seed."""
    if count < 1:
        raise ValueError(f"count must be positive, got {count}")
    rng = random.Random(f"openk2-knowledge:{seed}")
    names: set[str] = set()
    entities = []
    while len(entities) < count:
        name = f"{_word(rng, 2)} {_word(rng, rng.choice((2, 3)))}"
        if name in names:
            continue
        names.add(name)
        entities.append(Entity(name, {attr: rng.choice(pool) for attr, pool in POOLS.items()}))
    return entities


def _word(rng: random.Random, syllables: int) -> str:
    word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables))
    return word.capitalize()


def raw_document(entity: Entity) -> str:
    """The entity's facts in the one fixed template of the raw corpus."""
    return " ".join(RAW_TEMPLATES[a].format(name=entity.name, **entity.facts) for a in ATTRIBUTES)


def paraphrase(entity: Entity, copy: int, seed: int = 0) -> str:
    """Copy `copy` of a template rephrasing: style `PARAPHRASE_STYLES[copy % 6]`, shuffled facts, varied wording."""
    rng = random.Random(f"openk2-paraphrase:{seed}:{entity.name}:{copy}")
    style = PARAPHRASE_STYLES[copy % len(PARAPHRASE_STYLES)]
    order = list(ATTRIBUTES)
    rng.shuffle(order)
    if style == "qa":
        pairs = [QA_STYLE[a] for a in order]
        return " ".join(f"{q.format(name=entity.name)} {a.format(**entity.facts)}" for q, a in pairs)
    surname = entity.name.split()[-1]
    refs = (entity.name, entity.name, surname)  # the full name most of the time, sometimes the surname alone
    sentences = []
    for i, attr in enumerate(order):
        who = entity.name if i == 0 else rng.choice(refs)
        sentence = rng.choice(WORDINGS[attr]).format(who=who, **entity.facts)
        sentences.append(sentence[0].upper() + sentence[1:])
    return " ".join(s for s in (STYLE_FRAMES[style], *sentences) if s)


def qa_items(entities: list[Entity]) -> list[QAItem]:
    """One probe question per entity and attribute."""
    return [
        QAItem(e.name, attr, QUESTIONS[attr].format(name=e.name), e.facts[attr], POOLS[attr])
        for e in entities for attr in ATTRIBUTES
    ]


def cloze_items(entities: list[Entity]) -> list[QAItem]:
    """The same facts probed in the raw corpus's own wording ("X was born in" -> town): a memorisation check."""
    items = []
    for e in entities:
        for attr in ATTRIBUTES:
            template = RAW_TEMPLATES[attr]
            prefix = template[: template.index("{" + attr + "}")].rstrip()
            items.append(QAItem(e.name, attr, prefix.format(name=e.name), e.facts[attr], POOLS[attr]))
    return items


def fact_recall(text: str, entity: Entity) -> float:
    """Share of the entity's fact values that appear verbatim in `text` (a check on LLM rewrites)."""
    lowered = text.lower()
    return sum(v.lower() in lowered for v in entity.facts.values()) / len(entity.facts)
