"""`openk2 <command>`: the command-line entry point.

Every command is a module of this package (`openk2 X-Y` lives in `openk2/cli/x_y.py` as `x_y_main(argv) -> int`),
imported only when it runs; library packages hold no argument parsing. This file only routes, and turns a
`ValueError` (bad user input) into one line on stderr with exit code 2.
"""

from __future__ import annotations

import importlib
import sys

# name -> one-line help. The module is openk2.cli.<name with '-' as '_'>, its entry point <module name>_main.
COMMANDS: dict[str, str] = {
    "params": "parameter counts of a preset or HF config",
    "plan": "per-rank memory of a parallel run config, from the model built on the meta device",
    "tokenizer": "train a byte-level BPE tokenizer with K2's special tokens",
    "data": "pre-tokenise a run's corpus into memory-mapped token shards: `data tokenize --config FILE`",
    "pretrain": "pre-train with MuonClip on the shipped corpus (configs/tiny.toml)",
    "export": "HF safetensors from a training checkpoint's DCP shards (streamed, any parallel layout)",
    "sft": "supervised fine-tuning on chat/tool-use conversations (configs/sft-tiny.toml)",
    "plot": "write a run's loss, max-logit and expert-load plots",
    "rephrase": "rewrite a JSONL/Parquet corpus in several styles with an LLM, fidelity-checked",
    "synth": "agentic tool-use data synthesis: `synth tools` (repository), `synth run` (SFT data)",
    "chat": "terminal chat with any model spec (local:PATH, hf:smollm2, openai:URL#model)",
    "experiment": "re-measure the report's pre-training claims at small scale (list, NAME --quick)",
    "serve": "OpenAI-compatible chat server for a checkpoint (127.0.0.1 by default)",
    "rl": "colocated RL with partial rollout on a verifiable task (configs/rl-tiny.toml)",
    "rl-tasks": "the verifiable RL tasks: `rl-tasks list`, `sample NAME`, `check NAME RESPONSE`",
    "eval": "score a model on benchmarks (tau2, BFCL, HumanEval, math, ...): `eval --list`, `eval compare`",
    "redteam": "safety red-team: plugin x strategy pass rates with attacker and judge models",
    "pipeline": "tokenizer -> pretrain -> SFT -> RL, evaluated after each, and a report",
    "sandbox": "code-execution sandbox service: `sandbox serve` (POST /run, bearer token)",
}


def command_entry(name: str):
    """The `<name>_main(argv) -> int` function of command `name`."""
    module_name = name.replace("-", "_")
    module = importlib.import_module(f"openk2.cli.{module_name}")
    return getattr(module, f"{module_name}_main")


def main(argv: list[str] | None = None) -> int:
    """Route `openk2 <command> [options]` to the command's module."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: openk2 <command> [options]\n\ncommands:")
        for name, help_text in COMMANDS.items():
            print(f"  {name:<12}{help_text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"openk2: unknown command {name!r}; run `openk2 --help`", file=sys.stderr)
        return 2
    try:
        return command_entry(name)(rest)
    except ValueError as err:  # user errors: one clear line, no traceback
        print(f"openk2 {name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
