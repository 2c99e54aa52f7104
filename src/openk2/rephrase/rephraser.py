"""Rephrasing for pre-training data (report section 2.2): more useful tokens from the same knowledge.

One document becomes one or more rewrites, each in a style from the prompt bank (`rephrase_prompts`):

1. chunk-wise autoregressive rewriting: the document is cut at paragraph/sentence boundaries into segments that
   fit the LLM (`chunking.split_segments`); each segment is rewritten with the tail of the rewrite so far in the
   prompt, so the parts read as one text, and the parts are stitched back with the source's breaks;
2. fidelity verification: each source segment and its rewrite are embedded with MiniLM and compared by cosine
   similarity; a rewrite with any segment under `min_similarity` is rejected. An optional LLM judge then asks,
   segment by segment, whether facts were added or lost.

`rephrase_corpus` runs this over sharded JSONL/Parquet with many concurrent requests (`ChatModel.achat` under a
semaphore). Its output directory is also its journal: one line per finished (document, copy) in the output or
reject shard, so an interrupted run picks up exactly the unfinished work. A model endpoint that stays down after
the backend's retries (`openk2.llm.transport`) finishes nothing: the run stops with `EndpointUnreachable`, the
units in hand stay pending, and rerunning the same command does them.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from openk2.data.chunking import split_segments, stitch
from openk2.llm.base import ChatModel
from openk2.llm.transport import EndpointUnreachable, describe, is_transport_error
from openk2.rephrase.prompts import (
    RephraseStyle,
    clean_rewrite,
    judge_messages,
    load_styles,
    parse_verdict,
    rewrite_messages,
    select_styles,
)

INPUT_SUFFIXES = (".jsonl", ".parquet")
REJECTS_FILE = "rejects.jsonl"
STATS_FILE = "stats.json"


class Embedder(Protocol):
    """What fidelity checking needs: unit-norm sentence vectors (e.g. `openk2.data.embed.SentenceEmbedder`)."""

    def encode(self, texts: Sequence[str]) -> torch.Tensor: ...


@dataclass(kw_only=True)
class RephraseConfig:
    """How documents are rewritten and checked."""

    segment_chars: int = 1500  # longest source segment sent in one request (~400 tokens of English)
    context_chars: int = 600  # tail of the rewrite so far that goes into the next segment's prompt
    min_similarity: float = 0.70  # MiniLM cosine every segment's rewrite must reach
    judge: bool = False  # also ask an LLM judge whether each segment's rewrite adds or loses facts
    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int | None = None  # per segment; None: len(segment) / 2 + 64, room for a longer rewrite
    seed: int = 0

    def __post_init__(self) -> None:
        if self.segment_chars < 16:
            raise ValueError(f"segment_chars must be at least 16, got {self.segment_chars}")
        if self.context_chars < 0:
            raise ValueError(f"context_chars must be >= 0, got {self.context_chars}")
        if not -1.0 <= self.min_similarity <= 1.0:
            raise ValueError(f"min_similarity is a cosine in [-1, 1], got {self.min_similarity}")


@dataclass
class RephraseResult:
    """One rewrite of one document: its text, or the reason it was rejected."""

    text: str | None
    reason: str | None = None  # None when accepted
    similarity: float | None = None  # lowest segment similarity (None when not checked)
    segments: int = 0
    completion_tokens: int = 0

    @property
    def accepted(self) -> bool:
        return self.reason is None


class Rephraser:
    """Rewrites one document in one style: chunked, autoregressive, stitched, then verified."""

    def __init__(self, llm: ChatModel, embedder: Embedder | None, config: RephraseConfig | None = None,
                 judge: ChatModel | None = None, max_concurrency: int = 8) -> None:
        self.llm, self.embedder, self.cfg = llm, embedder, config or RephraseConfig()
        self.judge = judge if judge is not None else (llm if self.cfg.judge else None)
        self._requests = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
        self._embed_lock = asyncio.Lock()  # one embedding batch at a time: it already uses every core

    async def rephrase(self, text: str, style: RephraseStyle, seed: int = 0) -> RephraseResult:
        """The rewrite of `text` in `style`, or a rejection with its reason."""
        segments = split_segments(text, self.cfg.segment_chars)
        if not any(s.strip() for s in segments):
            return RephraseResult(None, "empty document")
        rewrites: list[str] = []
        tokens = 0
        for i, segment in enumerate(segments):
            previous = " ".join(rewrites)[-self.cfg.context_chars :] if self.cfg.context_chars else ""
            messages = rewrite_messages(style, segment, previous.lstrip(), i, len(segments))
            max_tokens = self.cfg.max_tokens or len(segment) // 2 + 64
            reply = await self._ask(self.llm, messages, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                    max_tokens=max_tokens, seed=seed + i)
            tokens += reply.usage.get("completion_tokens", 0)
            rewrite = clean_rewrite(reply.content)
            if not rewrite:
                return RephraseResult(None, f"empty rewrite of segment {i}", segments=len(segments),
                                      completion_tokens=tokens)
            if reply.finish_reason == "length":
                return RephraseResult(None, f"segment {i} hit max_tokens={max_tokens}", segments=len(segments),
                                      completion_tokens=tokens)
            rewrites.append(rewrite)
        result = RephraseResult(stitch(segments, rewrites), segments=len(segments), completion_tokens=tokens)
        return await self._verify(segments, rewrites, style, result)

    async def _verify(self, segments: list[str], rewrites: list[str], style: RephraseStyle,
                      result: RephraseResult) -> RephraseResult:
        if style.check_similarity and self.embedder is not None:
            async with self._embed_lock:
                sims = await asyncio.to_thread(segment_similarity, self.embedder, segments, rewrites)
            result.similarity = round(float(sims.min()), 4)
            if result.similarity < self.cfg.min_similarity:
                worst = int(sims.argmin())
                result.reason = (f"similarity {result.similarity:.3f} < {self.cfg.min_similarity} "
                                 f"(segment {worst})")
                return result
        if self.judge is not None:
            for i, (source, rewrite) in enumerate(zip(segments, rewrites, strict=True)):
                reply = await self._ask(self.judge, judge_messages(source, rewrite), temperature=0.0, max_tokens=8)
                verdict = parse_verdict(reply.content)
                if verdict is not True:
                    result.reason = f"judge: segment {i} " + ("adds or loses facts" if verdict is False
                                                              else "got no verdict")
                    return result
        return result

    async def _ask(self, model: ChatModel, messages: list[dict], **sampling):
        if self._requests is None:
            return (await model.achat(messages, **sampling))[0]
        async with self._requests:
            return (await model.achat(messages, **sampling))[0]


def segment_similarity(embedder: Embedder, sources: list[str], rewrites: list[str]) -> torch.Tensor:
    """Cosine similarity of each source segment and its rewrite: fp32 [len(sources)]."""
    vectors = embedder.encode([s.strip() for s in sources] + list(rewrites))
    return (vectors[: len(sources)] * vectors[len(sources) :]).sum(-1).float()


def rephrase_text(llm: ChatModel, text: str, style: str | RephraseStyle = "encyclopedic",
                  embedder: Embedder | None = None, config: RephraseConfig | None = None) -> RephraseResult:
    """Synchronous convenience: rewrite one document in one style."""
    if isinstance(style, str):
        style = select_styles([style], load_styles())[0]
    return asyncio.run(Rephraser(llm, embedder, config).rephrase(text, style, (config or RephraseConfig()).seed))


# --------------------------------------------------------------------------------------------- corpus runs
@dataclass(frozen=True)
class SourceRecord:
    """One input record, or the reason it cannot be used (`text` None)."""

    shard: str
    line: int
    doc_id: str
    text: str | None
    problem: str | None = None


@dataclass
class RunStats:
    """Counts of one corpus run (this session) plus the totals found in the output directory."""

    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason class -> count
    bad_records: int = 0
    skipped_done: int = 0
    completion_tokens: int = 0
    similarity_sum: float = 0.0
    similarity_count: int = 0

    def record(self, result: RephraseResult) -> None:
        self.completion_tokens += result.completion_tokens
        if result.similarity is not None:
            self.similarity_sum += result.similarity
            self.similarity_count += 1
        if result.accepted:
            self.accepted += 1
        else:
            self.rejected[reason_class(result.reason or "")] += 1

    @property
    def finished(self) -> int:
        return self.accepted + sum(self.rejected.values())


def reason_class(reason: str) -> str:
    """The reason without its details ("similarity 0.41 < 0.7 (segment 2)" -> "similarity")."""
    for prefix in ("similarity", "judge", "empty rewrite", "segment", "bad record", "error"):
        if reason.startswith(prefix):
            return {"segment": "max_tokens"}.get(prefix, prefix)
    return reason


def find_inputs(paths: Sequence[str | Path]) -> list[Path]:
    """Input shards: the given files, and every .jsonl/.parquet under given directories, in sorted order."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.suffix in INPUT_SUFFIXES and f.is_file())
            if not found:
                raise ValueError(f"no .jsonl or .parquet files under {p}")
            files += found
        elif p.is_file():
            if p.suffix not in INPUT_SUFFIXES:
                raise ValueError(f"{p}: input must be .jsonl or .parquet")
            files.append(p)
        else:
            raise ValueError(f"input {p} does not exist")
    stems = [f.stem for f in files]
    dupes = sorted({s for s in stems if stems.count(s) > 1})
    if dupes:
        raise ValueError(f"input shards must have distinct names (their outputs are named after them): {dupes}")
    return files


def read_records(path: Path, text_field: str = "text", id_field: str = "id") -> Iterator[SourceRecord]:
    """Records of one shard; a record without usable text comes back with `problem` set instead of failing."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as err:
            raise ValueError(f"{path}: not a readable Parquet file ({err})") from None
        if text_field not in table.column_names:
            raise ValueError(f"{path}: no column {text_field!r}; columns are {table.column_names}")
        texts = table.column(text_field).to_pylist()
        ids = table.column(id_field).to_pylist() if id_field in table.column_names else [None] * len(texts)
        for i, (text, rid) in enumerate(zip(texts, ids, strict=True), 1):
            yield _record(path, i, rid, text, text_field)
        return
    with path.open("rb") as fh:
        for i, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield SourceRecord(path.stem, i, f"{path.stem}:{i}", None,
                                   f"not valid UTF-8 (offset {err.start} of the line)")
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                yield SourceRecord(path.stem, i, f"{path.stem}:{i}", None, f"invalid JSON: {err.msg}")
                continue
            if not isinstance(obj, dict):
                yield SourceRecord(path.stem, i, f"{path.stem}:{i}", None, "record is not a JSON object")
                continue
            yield _record(path, i, obj.get(id_field), obj.get(text_field), text_field)


def _record(path: Path, line: int, rid, text, text_field: str) -> SourceRecord:
    doc_id = str(rid) if isinstance(rid, str | int) and not isinstance(rid, bool) else f"{path.stem}:{line}"
    if not isinstance(text, str):
        return SourceRecord(path.stem, line, doc_id, None, f"no string field {text_field!r}")
    if not text.strip():
        return SourceRecord(path.stem, line, doc_id, None, "empty text")
    return SourceRecord(path.stem, line, doc_id, text)


class Journal:
    """Append-only JSONL with crash repair: a torn last line (killed mid-write) is cut off when opened."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: set[tuple[str, int]] = set()  # (source_id, copy) of every complete line
        if path.exists():
            self._repair_and_read()
        self._fh = path.open("a", encoding="utf-8")

    def _repair_and_read(self) -> None:
        data = self.path.read_bytes()
        good = 0
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break
            self.done.add((record["source_id"], record["copy"]))
            good += len(line)
        if good < len(data):
            with self.path.open("r+b") as fh:
                fh.truncate(good)

    def write(self, record: dict) -> None:
        # One write of one whole line, flushed: a crash leaves whole lines and at most one torn tail.
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()


@dataclass(kw_only=True)
class CorpusJob:
    """What `rephrase_corpus` does: inputs, output directory, styles and copies, and run settings."""

    inputs: list[Path]
    output: Path
    styles: list[RephraseStyle]
    copies: int = 1
    text_field: str = "text"
    id_field: str = "id"
    concurrency: int = 8  # LLM requests in flight
    output_format: str = "jsonl"  # "parquet" also writes <shard>.parquet once everything is done
    limit: int | None = None  # process at most this many input records (all shards together)

    def __post_init__(self) -> None:
        if self.copies < 1:
            raise ValueError(f"copies must be positive, got {self.copies}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be positive, got {self.concurrency}")
        if self.output_format not in ("jsonl", "parquet"):
            raise ValueError(f"output format must be jsonl or parquet, got {self.output_format!r}")
        if not self.styles:
            raise ValueError("at least one style is needed")


def unit_style(job: CorpusJob, doc_id: str, copy: int) -> RephraseStyle:
    """The style of one copy: copies of a document cycle through the styles from a per-document offset."""
    return job.styles[(zlib.crc32(doc_id.encode()) + copy) % len(job.styles)]


def unit_seed(base: int, doc_id: str, copy: int) -> int:
    """A sampling seed fixed by (run seed, document, copy), so a resumed unit asks the same question."""
    return zlib.crc32(f"{base}:{doc_id}:{copy}".encode()) % (2**31)


async def rephrase_corpus(job: CorpusJob, rephraser: Rephraser) -> dict:
    """Rewrite every input document `job.copies` times into `job.output`, resuming finished work; stats dict."""
    job.output.mkdir(parents=True, exist_ok=True)
    rejects = Journal(job.output / REJECTS_FILE)
    outputs = {f.stem: Journal(job.output / f"{f.stem}.jsonl") for f in job.inputs}
    done = set().union(*(j.done for j in (rejects, *outputs.values())))
    stats = RunStats()
    bar = tqdm(total=_count_units(job), desc="rephrase", unit="doc", dynamic_ncols=True, disable=None)
    start = time.perf_counter()
    pending: set[asyncio.Task] = set()
    seen: set[str] = set()

    def report_progress() -> None:
        elapsed = max(time.perf_counter() - start, 1e-9)
        acc = stats.accepted / stats.finished if stats.finished else float("nan")
        bar.set_postfix(docs_s=f"{stats.finished / elapsed:.2f}", accept=f"{acc:.0%}")

    async def work(rec: SourceRecord, copy: int) -> None:
        style = unit_style(job, rec.doc_id, copy)
        try:
            result = await rephraser.rephrase(rec.text or "", style, unit_seed(rephraser.cfg.seed, rec.doc_id, copy))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # a failed request is a reject with its reason, not a lost run
            if is_transport_error(err):  # ... unless the endpoint is down: then the unit stays pending
                raise
            result = RephraseResult(None, f"error: {type(err).__name__}: {err}")
        stats.record(result)
        base = {"source_id": rec.doc_id, "copy": copy, "style": style.name}
        if result.accepted:
            outputs[rec.shard].write({"id": f"{rec.doc_id}#{copy}", **base, "text": result.text,
                                      "similarity": result.similarity, "segments": result.segments})
        else:
            rejects.write({**base, "shard": rec.shard, "line": rec.line, "reason": result.reason,
                           "similarity": result.similarity})
        bar.update(1)
        report_progress()

    try:
        for n, rec in enumerate(_records(job)):
            if job.limit is not None and n >= job.limit:
                break
            problem = rec.problem or ("duplicate id" if rec.doc_id in seen else None)
            seen.add(rec.doc_id)
            if problem is not None:  # keyed by position: a bad record may have no usable id
                where = f"{rec.shard}:{rec.line}"
                if (where, -1) not in done:
                    rejects.write({"source_id": where, "copy": -1, "doc_id": rec.doc_id, "shard": rec.shard,
                                   "line": rec.line, "reason": f"bad record: {problem}"})
                    stats.bad_records += 1
                bar.update(job.copies)
                continue
            for copy in range(job.copies):
                if (rec.doc_id, copy) in done:
                    stats.skipped_done += 1
                    bar.update(1)
                    continue
                while len(pending) >= 2 * job.concurrency:  # bounded look-ahead: memory stays flat
                    finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in finished:
                        task.result()
                pending.add(asyncio.create_task(work(rec, copy)))
        if pending:
            for task in (await asyncio.wait(pending))[0]:
                task.result()
    except Exception as err:
        if not is_transport_error(err):
            raise
        raise EndpointUnreachable(
            f"the model could not be reached after its retries ({describe(err)}); {stats.finished} unit(s) "
            f"finished this session, all finished work is kept in {job.output}: rerun the same command to do "
            "the rest") from err
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        bar.close()
        for journal in (rejects, *outputs.values()):
            journal.close()
    elapsed = time.perf_counter() - start
    if job.output_format == "parquet":
        for stem in outputs:
            jsonl_to_parquet(job.output / f"{stem}.jsonl", job.output / f"{stem}.parquet")
    summary = corpus_stats(job.output, [f.stem for f in job.inputs])
    summary["session"] = {
        "finished": stats.finished, "accepted": stats.accepted, "rejected": dict(stats.rejected),
        "bad_records": stats.bad_records, "skipped_already_done": stats.skipped_done,
        "elapsed_s": round(elapsed, 2), "docs_per_s": round(stats.finished / elapsed, 4) if elapsed else None,
        "completion_tokens": stats.completion_tokens,
        "completion_tokens_per_s": round(stats.completion_tokens / elapsed, 2) if elapsed else None,
        "mean_similarity": (round(stats.similarity_sum / stats.similarity_count, 4)
                            if stats.similarity_count else None),
    }
    _write_atomic(job.output / STATS_FILE, json.dumps(summary, indent=2))
    return summary


def _records(job: CorpusJob) -> Iterator[SourceRecord]:
    for path in job.inputs:
        yield from read_records(path, job.text_field, job.id_field)


def _count_units(job: CorpusJob) -> int:
    # A cheap pass for the progress bar: lines of JSONL, row counts from Parquet metadata.
    count = 0
    for path in job.inputs:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            count += pq.ParquetFile(path).metadata.num_rows
        else:
            with path.open("rb") as fh:
                count += sum(1 for line in fh if line.strip())
    if job.limit is not None:
        count = min(count, job.limit)
    return count * job.copies


def corpus_stats(output: Path, shards: list[str]) -> dict:
    """Totals over everything in the output directory (all sessions): accepted, rejected by reason."""
    accepted = 0
    sims = []
    for stem in shards:
        path = output / f"{stem}.jsonl"
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                rec = json.loads(line)
                accepted += 1
                if rec.get("similarity") is not None:
                    sims.append(rec["similarity"])
    rejected: Counter = Counter()
    bad = 0
    path = output / REJECTS_FILE
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            if rec.get("copy") == -1:
                bad += 1
            else:
                rejected[reason_class(rec.get("reason", ""))] += 1
    finished = accepted + sum(rejected.values())
    return {"accepted": accepted, "rejected": dict(rejected), "bad_records": bad,
            "acceptance_rate": round(accepted / finished, 4) if finished else None,
            "mean_similarity_accepted": round(sum(sims) / len(sims), 4) if sims else None}


def jsonl_to_parquet(src: Path, dst: Path) -> None:
    """Write a JSONL shard as Parquet, atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in src.read_text(encoding="utf-8").splitlines()]
    tmp = dst.with_suffix(".parquet.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(dst)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
