"""Rephrasing vs repetition at equal tokens (report section 2.2, the SimpleQA comparison).

The report trains an early K2 checkpoint on a knowledge corpus three ways and measures SimpleQA accuracy:
raw data for 10 epochs (23.76%), one rephrasing for 10 epochs (27.39%), ten rephrasings for one epoch (28.94%).
Here the same three arms train the tiny model from scratch on a synthetic corpus of invented people
(`openk2.data.knowledge`), so every answer is checkable and unknown to any pre-trained model:

- raw-x10: the raw documents (one fixed template), 10 epochs;
- rephrase1-x10: one programmatic rephrasing of each document, 10 epochs;
- rephrase10-x1: ten different rephrasings of each document, one epoch.

All arms train for the same number of optimizer steps of the same batch shape (= 10 epochs of the raw corpus),
with the same tokenizer, model, optimizer and seed. The probe asks each fact as a question in a wording absent
from all training text and ranks the fact's whole value pool by log-likelihood (chance = 1/16); a second probe
asks in the raw corpus's own wording (cloze), which measures memorisation of that template.

Rephrasings come from the documented template paraphraser (`knowledge.paraphrase`), not the LLM: the default local
model (SmolLM2-135M) mostly copies the source or drops facts (measured in docs/benchmarks.md), so the comparison
would test its errors; a stronger model is not available offline.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from openk2.data.corpus import split_documents
from openk2.data.knowledge import (
    ATTRIBUTES,
    Entity,
    QAItem,
    cloze_items,
    make_entities,
    paraphrase,
    qa_items,
    raw_document,
)
from openk2.data.tokenizer import K2Tokenizer, train_tokenizer
from openk2.experiments.common import (
    BASE_MODEL,
    MICRO_MODEL,
    check_mode,
    command_line,
    micro_budget,
    write_atomic,
    write_report,
)
from openk2.model import K2ForCausalLM
from openk2.train.config import RunConfig

DESCRIPTION = "rephrasing vs repetition at equal tokens: QA accuracy of raw x10, 1 rephrasing x10, 10 rephrasings x1"

REPORT_NUMBERS = {"raw-x10": 23.76, "rephrase1-x10": 27.39, "rephrase10-x1": 28.94}  # SimpleQA %, section 2.2
ARMS = tuple(REPORT_NUMBERS)
EPOCHS = 10
NAME = "rephrase-vs-repeat"
ARM_RESULT = "arm_result.json"
VAL_SOURCE_VAL_FRACTION = 1e-9  # > 0 so exactly one document (the filler) is held out for validation


@dataclass(frozen=True)
class Size:
    """How big one mode of the experiment is."""

    entities: int  # entities asked about in the probe (all of them are in every arm's training data)
    val_entities: int  # extra entities whose raw documents form the held-out validation document
    seq_len: int
    batch_size: int  # small: at a fixed token budget, more optimizer steps memorise more facts
    lr: float
    model: dict  # the experiments' shared base model (common.BASE_MODEL) with these overrides


SIZES = {
    "quick": Size(entities=240, val_entities=40, seq_len=128, batch_size=4, lr=3e-3,
                  model={**BASE_MODEL, "vocab_size": 2048}),
    "full": Size(entities=1000, val_entities=80, seq_len=256, batch_size=8, lr=3e-3,
                 model={**BASE_MODEL, "vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 4}),
}
MICRO = Size(entities=3, val_entities=10, seq_len=64, batch_size=4, lr=3e-3,
             model={**BASE_MODEL, **MICRO_MODEL, "vocab_size": 512})  # tests: plumbing only, seconds per arm


def run(out_dir: Path, mode: str, seed: int) -> Path:
    """Build the corpus, train the three arms, probe each, and write report.md + PNG; return the report path."""
    check_mode(mode)
    size = MICRO if micro_budget() else SIZES[mode]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    everyone = make_entities(size.entities + size.val_entities, seed)
    entities, val_entities = everyone[: size.entities], everyone[size.entities :]
    corpora = arm_corpora(entities, seed)
    val_doc = "\n".join(raw_document(e) for e in val_entities)

    tok_dir = out_dir / "tokenizer"
    vocab = RunConfig.from_dict({"model": size.model}).model.vocab_size
    tokenizer = train_tokenizer([d for docs in corpora.values() for d in docs] + [val_doc], vocab)
    tokenizer.save(tok_dir)
    raw_tokens = sum(len(ids) + 1 for ids in tokenizer.encode_batch(corpora["raw-x10"]))  # + EOS each
    steps = math.ceil(EPOCHS * raw_tokens / (size.batch_size * size.seq_len))

    results = {}
    for i, arm in enumerate(ARMS):
        print(f"[{i + 1}/{len(ARMS)}] {arm}: {steps} steps", flush=True)
        results[arm] = cached_arm(out_dir / arm, {"arm": arm, "steps": steps, "seed": seed, "size": asdict(size)})
        if results[arm] is None:
            results[arm] = train_and_probe(arm, corpora[arm], val_doc, entities, size, steps, tok_dir,
                                           out_dir / arm, seed)
    meta = {"mode": mode, "seed": seed, "steps": steps, "raw_tokens": raw_tokens, "size": asdict(size),
            "paraphraser": "template (openk2.data.knowledge.paraphrase)", "chance": 1 / 16,
            "majority_baseline": round(majority_baseline(entities), 4),
            "wall_s": round(time.perf_counter() - start, 1),
            "arm_s": round(sum(r["train_s"] + r["probe_s"] for r in results.values()), 1),
            "command": command_line(NAME, mode, seed, out_dir)}
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "arms": results}, indent=2))
    plot = plot_results(results, out_dir / "qa_accuracy.png")
    return write_report(out_dir, title="Rephrasing vs repetition at equal tokens (report section 2.2)",
                        setup=setup_text(meta), table=results_table(results), extra=by_fact_text(results),
                        conclusion=conclusion_text(results, size.entities * len(ATTRIBUTES),
                                                   meta["majority_baseline"]),
                        command=meta["command"], plots=[plot])


def cached_arm(run_dir: Path, key: dict) -> dict | None:
    """The saved result of an arm trained before with the same settings (so a crashed run resumes), else None."""
    path = run_dir / ARM_RESULT
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return saved["result"] if saved.get("key") == key else None


def arm_corpora(entities: list[Entity], seed: int) -> dict[str, list[str]]:
    """Training documents of each arm (before repetition): raw, one rephrasing, ten rephrasings."""
    return {
        "raw-x10": [raw_document(e) for e in entities],
        "rephrase1-x10": [paraphrase(e, 0, seed) for e in entities],
        "rephrase10-x1": [paraphrase(e, k, seed) for k in range(EPOCHS) for e in entities],
    }


def write_arm_source(docs: list[str], val_doc: str, path: Path, seed: int) -> None:
    """One JSONL source whose seeded train/val split holds out exactly `val_doc` and no training document.

    `split_documents` is deterministic given (count, seed, name), so the held-out index is known in advance; the
    validation document is put there, and every fact the probe asks about stays in the training split.
    """
    # The corpus drops exact duplicates before splitting, so do it here first (two template rephrasings of one
    # person can coincide) or the held-out index would shift onto a training document.
    docs = list(dict.fromkeys(docs))
    probe = [str(i) for i in range(len(docs) + 1)]
    held_out = split_documents(probe, VAL_SOURCE_VAL_FRACTION, seed, "knowledge")["val"]
    assert len(held_out) == 1, held_out
    docs.insert(int(held_out[0]), val_doc)
    with path.open("w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps({"text": doc}) + "\n")


def train_and_probe(arm: str, docs: list[str], val_doc: str, entities: list[Entity], size: Size, steps: int,
                    tok_dir: Path, run_dir: Path, seed: int) -> dict:
    """Train one arm for `steps` steps and return its probe accuracies and training facts."""
    from openk2.train.trainer import Trainer

    run_dir.mkdir(parents=True, exist_ok=True)
    source = run_dir / "train.jsonl"
    write_arm_source(docs, val_doc, source, seed)
    cfg = RunConfig.from_dict({
        "model": size.model,
        "tokenizer": {"path": str(tok_dir)},
        "data": {"seq_len": size.seq_len, "val_fraction": VAL_SOURCE_VAL_FRACTION, "seed": seed,
                 "doc_chars": max(8192, len(val_doc) + 1),
                 "sources": [{"kind": "jsonl", "name": "knowledge", "path": str(source)}]},
        "optim": {"lr": size.lr, "bias_update_rate": 0.01},
        "schedule": {"warmup_steps": min(20, steps // 10), "decay_fraction": 0.3},
        "train": {"steps": steps, "batch_size": size.batch_size, "seed": seed, "log_every": 10,
                  "eval_every": steps, "eval_batches": 4, "checkpoint_every": steps, "keep_checkpoints": 1},
    })
    start = time.perf_counter()
    trainer = Trainer(cfg, out_dir=run_dir)
    summary = trainer.run()
    train_s = time.perf_counter() - start
    model, tokenizer = trainer.model.eval(), trainer.tokenizer
    epochs = trainer.train_loader.tokens_emitted["knowledge"] / sum(
        len(ids) + 1 for ids in tokenizer.encode_batch(docs))
    start = time.perf_counter()
    qa = probe_accuracy(model, tokenizer, qa_items(entities))
    cloze = probe_accuracy(model, tokenizer, cloze_items(entities))
    result = {"docs": len(set(docs)), "steps": summary.step, "tokens_seen": trainer.tokens_seen,
              "epochs": round(epochs, 2), "val_loss": summary.val_loss, "train_s": round(train_s, 1),
              "probe_s": round(time.perf_counter() - start, 1), "tokens_per_s": round(summary.tokens_per_s),
              "qa_accuracy": qa["accuracy"], "qa_by_attribute": qa["by_attribute"],
              "cloze_accuracy": cloze["accuracy"], "cloze_by_attribute": cloze["by_attribute"]}
    key = {"arm": arm, "steps": steps, "seed": seed, "size": asdict(size)}
    write_atomic(run_dir / ARM_RESULT, json.dumps({"key": key, "result": result}, indent=2))
    return result


def probe_accuracy(model: K2ForCausalLM, tokenizer: K2Tokenizer, items: list[QAItem]) -> dict:
    """Share of items whose right answer has the highest log-likelihood among all candidates (and per attribute)."""
    scores = candidate_scores(model, tokenizer, items)
    correct: dict[str, list[bool]] = {a: [] for a in ATTRIBUTES}
    for item, per in zip(items, scores, strict=True):
        correct[item.attribute].append(item.candidates[int(per.argmax())] == item.answer)
    flat = [c for per in correct.values() for c in per]
    return {"accuracy": sum(flat) / len(flat),
            "by_attribute": {a: sum(v) / len(v) for a, v in correct.items() if v}}


@torch.no_grad()
def candidate_scores(model: K2ForCausalLM, tokenizer: K2Tokenizer, items: list[QAItem],
                     batch_size: int = 128) -> list[torch.Tensor]:
    """Per item, the summed log-probability of each candidate " value" after EOS + prompt.

    EOS first because that is how a document starts in the packed training stream. One row per item (the prompt
    alone) scores every one-token candidate at once; only longer candidates get a row of their own, which saves
    most of the forward passes of scoring 16 candidates per question.
    """
    device = next(model.parameters()).device
    prompts = [[tokenizer.eos_id, *tokenizer.encode(item.prompt)] for item in items]
    answers = [[tokenizer.encode(" " + cand) for cand in item.candidates] for item in items]
    rows = [(i, None) for i in range(len(items))]  # (item, candidate or None for the prompt-only row)
    rows += [(i, k) for i, cands in enumerate(answers) for k, c in enumerate(cands) if len(c) > 1]
    scores = [torch.empty(len(item.candidates)) for item in items]
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        seqs = [prompts[i] + (answers[i][k] if k is not None else []) for i, k in batch]
        ids = torch.full((len(seqs), max(map(len, seqs))), tokenizer.eos_id, dtype=torch.long)
        for r, seq in enumerate(seqs):
            ids[r, : len(seq)] = torch.tensor(seq)  # right padding leaves the causal prefix untouched
        logprobs = torch.log_softmax(model(ids.to(device)).logits.float(), dim=-1).cpu()
        for r, (i, k) in enumerate(batch):
            last = len(prompts[i]) - 1  # logits at t predict token t + 1
            if k is None:
                for j, c in enumerate(answers[i]):
                    if len(c) == 1:
                        scores[i][j] = logprobs[r, last, c[0]]
            else:
                c = answers[i][k]
                scores[i][k] = logprobs[r, torch.arange(last, last + len(c)), torch.tensor(c)].sum()
    return scores


def plot_results(results: dict, path: Path) -> Path:
    """Bar chart of QA and cloze accuracy per arm, with the chance line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    xs = range(len(results))
    ax.bar([x - 0.2 for x in xs], [100 * r["qa_accuracy"] for r in results.values()], 0.4, label="QA probe")
    ax.bar([x + 0.2 for x in xs], [100 * r["cloze_accuracy"] for r in results.values()], 0.4,
           label="cloze (raw wording)")
    ax.axhline(100 / 16, color="gray", linestyle="--", linewidth=1, label="chance (1/16)")
    ax.set_xticks(list(xs), list(results))
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Rephrasing vs repetition at equal tokens (tiny K2)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def verdict(results: dict, num_questions: int, chance: float = 1 / 16) -> str:
    """Plain sentences on whether the QA numbers support the report's raw < rephrase1 < rephrase10.

    A gap counts only beyond two standard errors (binomial, `num_questions` per arm); with no arm measurably above
    `chance` (pass the majority baseline: a model can learn which values are common without learning any fact)
    the comparison is called inconclusive, whatever the ordering of the numbers.
    """
    qa = {arm: results[arm]["qa_accuracy"] for arm in ARMS}
    numbers = ", ".join(f"{arm} {100 * v:.1f}%" for arm, v in qa.items())
    floor = chance + 2 * math.sqrt(chance * (1 - chance) / num_questions)
    if max(qa.values()) <= floor:
        return (f"Inconclusive: no arm answers measurably above the majority baseline ({numbers}; baseline "
                f"{100 * chance:.1f}%, two standard errors above it {100 * floor:.1f}%), so this run neither supports "
                f"nor contradicts "
                f"the report's claim. The model did not learn the facts within this training budget, and a larger "
                f"one is needed before the arms can be compared.")

    def beats(a: str, b: str) -> bool:
        pa, pb = qa[a], qa[b]
        return pa - pb > 2 * math.sqrt((pa * (1 - pa) + pb * (1 - pb)) / num_questions)

    one, ten = beats("rephrase1-x10", "raw-x10"), beats("rephrase10-x1", "raw-x10")
    if one and ten:
        head = "The small-scale result agrees with the report's claim: both rephrasing arms beat repetition"
        head += (" and ten rephrasings beat one" if beats("rephrase10-x1", "rephrase1-x10")
                 else ", though ten rephrasings are not measurably better than one")
    elif one or ten:
        head = ("The small-scale result partly agrees with the report's claim: only "
                + ("one rephrasing x10" if one else "ten rephrasings x1") + " beats repetition measurably")
    elif beats("raw-x10", "rephrase1-x10") or beats("raw-x10", "rephrase10-x1"):
        head = "The small-scale result contradicts the report's claim: repetition of the raw data beats rephrasing"
    else:
        head = "The small-scale result does not show the report's effect: the arms are within two standard errors"
    return f"{head} ({numbers}; {num_questions} questions per arm; gaps counted beyond two standard errors)."


def setup_text(meta: dict) -> str:
    size = meta["size"]
    n_q = size["entities"] * len(ATTRIBUTES)
    return (
        f"Mode `{meta['mode']}`, seed {meta['seed']}. {size['entities']} invented people with {len(ATTRIBUTES)} "
        f"facts each (`openk2.data.knowledge`); {n_q} probe questions, each answered by ranking the fact's 16 "
        f"possible values by log-likelihood (chance 6.25%; always answering the most common value of each fact "
        f"scores {100 * meta['majority_baseline']:.1f}% on these people). Every arm trains the same model from the "
        f"same initialisation for {meta['steps']} steps of {size['batch_size']} x {size['seq_len']} tokens, i.e. "
        f"{EPOCHS} epochs of the {meta['raw_tokens']:,}-token raw corpus: raw-x10 repeats the raw documents, "
        f"rephrase1-x10 repeats one rephrasing of each, rephrase10-x1 reads ten different rephrasings once. "
        f"Rephrasings: {meta['paraphraser']}, not an LLM (the local SmolLM2-135M copies or loses facts; "
        f"see docs/benchmarks.md). Model: hidden {size['model']['hidden_size']}, {size['model']['num_hidden_layers']} "
        f"layers, {size['model']['n_routed_experts']} experts, vocab {size['model']['vocab_size']}. "
        f"Training + probing took {meta['arm_s'] / 60:.1f} min summed over the arms (this invocation: "
        f"{meta['wall_s'] / 60:.1f} min; arms finished by an earlier invocation are reused; times depend on how "
        f"busy the machine was)."
    )


def results_table(results: dict) -> str:
    lines = ["| arm | docs | epochs seen | QA accuracy | cloze accuracy (raw wording) | val loss | report (SimpleQA) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for arm, r in results.items():
        val = f"{r['val_loss']:.3f}" if r["val_loss"] is not None else "-"
        lines.append(f"| {arm} | {r['docs']} | {r['epochs']:.2f} | {100 * r['qa_accuracy']:.1f}% | "
                     f"{100 * r['cloze_accuracy']:.1f}% | {val} | {REPORT_NUMBERS[arm]:.2f}% |")
    return "\n".join(lines)


def by_fact_text(results: dict) -> str:
    return "QA accuracy by fact: " + "; ".join(
        f"{arm}: " + ", ".join(f"{a} {100 * v:.0f}%" for a, v in r["qa_by_attribute"].items())
        for arm, r in results.items()) + "."


def majority_baseline(entities: list[Entity]) -> float:
    """QA accuracy of always answering each fact's most common value among `entities` (above 1/16 by sampling)."""
    best = [max(Counter(e.facts[a] for e in entities).values()) for a in ATTRIBUTES]
    return sum(best) / (len(ATTRIBUTES) * len(entities))


def conclusion_text(results: dict, num_questions: int, baseline: float) -> str:
    return "\n".join([
        verdict(results, num_questions, baseline),
        "",
        "Limits: one seed and one small model, so a gap of a few points between arms is within what another seed "
        "could change (rerun with `--seed`); the rephrasings are template-based (five wordings per fact, six "
        "styles, shuffled order), far less varied than an LLM's, and the probe's wording appears in none of "
        "them. The cloze column asks in the raw documents' own wording, so it favours raw-x10 by design. The val "
        "loss is on held-out raw-template documents of other people and likewise favours the raw arm.",
    ])
