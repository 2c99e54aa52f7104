"""`openk2 rephrase`: rewrite a JSONL/Parquet corpus in several styles with an LLM, fidelity-checked, resumable."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from openk2.llm.transport import EndpointUnreachable, describe, is_transport_error
from openk2.rephrase.prompts import DEFAULT_STYLES, load_styles, select_styles
from openk2.rephrase.rephraser import CorpusJob, RephraseConfig, Rephraser, find_inputs, rephrase_corpus


def rephrase_main(argv: list[str] | None = None) -> int:
    """`openk2 rephrase`: rewrite a corpus in several styles with an LLM, verified, resumable."""
    parser = argparse.ArgumentParser(
        prog="openk2 rephrase",
        description="Rephrase a JSONL/Parquet corpus with an LLM (report section 2.2): chunk-wise rewriting in "
                    "several styles, MiniLM fidelity check, rejects with reasons, resumable output directory.")
    parser.add_argument("--input", nargs="+", help="JSONL/Parquet files or directories of them (required)")
    parser.add_argument("--output", help="output directory (required; re-running it resumes)")
    parser.add_argument("--llm", default="hf:smollm2", help="chat model spec: hf:smollm2, local:DIR, openai:URL#M")
    parser.add_argument("--styles", nargs="+", default=list(DEFAULT_STYLES),
                        help=f"style names from the bank (default: {' '.join(DEFAULT_STYLES)})")
    parser.add_argument("--style-file", help="JSON/TOML file adding or overriding styles")
    parser.add_argument("--list-styles", action="store_true", help="print the style bank and exit")
    parser.add_argument("--copies", type=int, default=1, help="rewrites per document (styles cycle)")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--id-field", default="id")
    parser.add_argument("--concurrency", type=int, default=8, help="LLM requests in flight")
    parser.add_argument("--segment-chars", type=int, default=RephraseConfig.segment_chars)
    parser.add_argument("--context-chars", type=int, default=RephraseConfig.context_chars)
    parser.add_argument("--min-similarity", type=float, default=RephraseConfig.min_similarity)
    parser.add_argument("--no-similarity", action="store_true", help="skip the MiniLM check")
    parser.add_argument("--judge", action="store_true", help="also ask an LLM judge about added/lost facts")
    parser.add_argument("--judge-llm", help="chat model spec of the judge (default: --llm)")
    parser.add_argument("--temperature", type=float, default=RephraseConfig.temperature)
    parser.add_argument("--max-tokens", type=int, help="per segment (default: len(segment)/2 + 64)")
    parser.add_argument("--limit", type=int, help="process at most this many input records")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl", dest="output_format")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    bank = load_styles(args.style_file)
    if args.list_styles:
        for style in bank.values():
            print(f"{style.name:<16}{style.mode:<11}{style.instruction}")
        return 0
    if not args.input or not args.output:
        raise ValueError("--input and --output are required (or use --list-styles)")
    cfg = RephraseConfig(segment_chars=args.segment_chars, context_chars=args.context_chars,
                         min_similarity=args.min_similarity, judge=args.judge, temperature=args.temperature,
                         max_tokens=args.max_tokens, seed=args.seed)
    job = CorpusJob(inputs=find_inputs(args.input), output=Path(args.output),
                    styles=select_styles(args.styles, bank), copies=args.copies, text_field=args.text_field,
                    id_field=args.id_field, concurrency=args.concurrency, output_format=args.output_format,
                    limit=args.limit)
    from openk2.llm.registry import load_chat_model

    try:
        llm = load_chat_model(args.llm)
        judge = load_chat_model(args.judge_llm) if args.judge and args.judge_llm else None
    except Exception as err:
        if not is_transport_error(err):
            raise
        print(f"openk2 rephrase: error: the model could not be reached ({describe(err)})", file=sys.stderr)
        return 1
    embedder = None
    if not args.no_similarity:
        from openk2.data.embed import default_embedder

        embedder = default_embedder()
    rephraser = Rephraser(llm, embedder, cfg, judge=judge, max_concurrency=job.concurrency)
    try:
        summary = asyncio.run(rephrase_corpus(job, rephraser))
    except KeyboardInterrupt:
        print(f"interrupted; finished work is kept in {job.output}, run the same command to resume",
              file=sys.stderr)
        return 130
    except EndpointUnreachable as err:  # nothing recorded for the units in hand: a rerun does them
        print(f"openk2 rephrase: error: {err}", file=sys.stderr)
        return 1
    finally:
        for model in (llm, judge):
            if model is not None:
                model.close()
    print(json.dumps(summary, indent=2))
    return 0
