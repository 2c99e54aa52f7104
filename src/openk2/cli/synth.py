"""`openk2 synth`: agentic tool-use data synthesis (report 3.1.1).

    openk2 synth tools --out tools.jsonl [--config C] [--mcp CMD]... [--model SPEC] [--no-synthetic]
    openk2 synth tools --stats tools.jsonl
    openk2 synth run --config configs/synth-tiny.toml --out runs/synth [--set section.key=value]...
    openk2 synth report --out runs/synth

`tools` builds the tool repository (MCP tools listed from the configured servers plus synthetic tools evolved
from the configured categories) and prints counts per source and domain; its intermediate work is kept in
`<out>.work/` so an interrupted build resumes. `run` runs the whole pipeline into a directory (resumable;
see `openk2.agentic.pipeline`), prints the final statistics and writes the acceptance report (`report.md`,
`funnel.png`, `rejections.png`: counts, acceptance rates and rejection reasons per stage, dedup, tool-call
validity, throughput); `report` rewrites that report from a run directory's `stages.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from pathlib import Path

from openk2.agentic.synth_config import load_synth_config
from openk2.agentic.tools import format_stats, read_tools, tool_stats
from openk2.llm.transport import EndpointUnreachable


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="openk2 synth", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tools", help="build (--out) or browse (--stats) a tool repository")
    t.add_argument("--out", help="JSONL file to write the repository to")
    t.add_argument("--stats", metavar="FILE", help="print counts per source and domain of a repository file")
    t.add_argument("--config", help="synth TOML config ([tools] and [models].generator are used)")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    t.add_argument("--mcp", action="append", metavar="CMD",
                   help="MCP server command to list tools from (repeatable; replaces tools.mcp_servers)")
    t.add_argument("--model", help="generator chat model spec (replaces models.generator)")
    t.add_argument("--no-synthetic", action="store_true", help="MCP tools only (no model needed)")
    t.add_argument("--json", action="store_true", help="print the statistics as JSON")
    r = sub.add_parser("run", help="tools -> agents -> tasks -> trajectories -> judged -> SFT JSONL")
    r.add_argument("--config", required=True, help="synth TOML config, e.g. configs/synth-tiny.toml")
    r.add_argument("--out", required=True, help="run directory (an interrupted run resumes from it)")
    r.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    rep = sub.add_parser("report", help="write report.md and plots of a run directory")
    rep.add_argument("--out", required=True, help="run directory of `openk2 synth run`")
    return p


def _tools(args: argparse.Namespace) -> int:
    if args.stats:
        stats = tool_stats(read_tools(args.stats))
        print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
        return 0
    if not args.out:
        raise ValueError("give --out FILE to build a repository or --stats FILE to browse one")
    from openk2.agentic.pipeline import SynthPipeline

    overrides = list(args.set)
    cfg = load_synth_config(args.config, overrides)
    if args.mcp is not None:
        cfg.tools.mcp_servers = list(args.mcp)
    if args.model:
        cfg.models.generator = args.model
    if args.no_synthetic:
        cfg.tools.categories = []
    out = Path(args.out)
    work = out.with_name(out.name + ".work")
    tools = asyncio.run(SynthPipeline(cfg, work).abuild_tools())
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(work / "tools.jsonl", out.with_name(out.name + ".tmp"))
    out.with_name(out.name + ".tmp").replace(out)
    stats = tool_stats(tools)
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    print(f"wrote {len(tools)} tools to {out}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from openk2.agentic.pipeline import SynthPipeline
    from openk2.agentic.report import write_report

    cfg = load_synth_config(args.config, args.set)
    stats = SynthPipeline(cfg, args.out).run()
    print(json.dumps(stats, indent=2))
    acc = stats["acceptance"]
    print(f"{acc['accepted']}/{acc['judged']} trajectories accepted -> {Path(args.out) / 'sft.jsonl'}")
    print(f"acceptance report: {write_report(args.out)}")
    return 0


def synth_main(argv: list[str] | None = None) -> int:
    """Entry point of `openk2 synth`; ValueErrors (bad config, bad files) reach the CLI as one line."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "report":
            from openk2.agentic.report import write_report

            print(f"acceptance report: {write_report(args.out)}")
            return 0
        return _tools(args) if args.command == "tools" else _run(args)
    except EndpointUnreachable as err:  # the items that needed the endpoint stay pending for a rerun
        print(f"openk2 synth: error: {err}", file=sys.stderr)
        return 1
