"""`openk2 <command>`: the command-line entry point. Each command lives in its own module; this file only routes."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable


def _params(argv: list[str]) -> int:
    from openk2.config import ModelConfig

    parser = argparse.ArgumentParser(prog="openk2 params", description="Parameter counts of a model preset")
    parser.add_argument("--preset", default="kimi-k2", choices=ModelConfig.preset_names())
    parser.add_argument("--config", help="an HF config.json (file or checkpoint directory) instead of a preset")
    parser.add_argument("--json", action="store_true", help="print JSON with keys total, activated, breakdown")
    args = parser.parse_args(argv)
    cfg = ModelConfig.from_hf(args.config) if args.config else ModelConfig.preset(args.preset)
    count = cfg.num_params()
    if args.json:
        print(json.dumps(count.as_dict(), indent=2))
        return 0
    print(format_param_table(count, title=args.config or args.preset))
    return 0


def format_param_table(count, title: str) -> str:
    """A human-readable table of a ParamCount."""
    rows = [f"{title}: parameters", f"{'component':<16}{'count':>20}{'share':>9}"]
    for name, n in count.breakdown.items():
        rows.append(f"{name:<16}{n:>20,}{n / count.total:>9.2%}")
    rows.append(f"{'total':<16}{count.total:>20,}")
    rows.append(f"{'activated':<16}{count.activated:>20,}{count.activated / count.total:>9.2%}")
    return "\n".join(rows)


def _tokenizer(argv: list[str]) -> int:
    from openk2.data.tokenizer import tokenizer_main

    return tokenizer_main(argv)


def _pretrain(argv: list[str]) -> int:
    from openk2.train.pretrain import main

    return main(argv)


def _sft(argv: list[str]) -> int:
    from openk2.train.sft import sft_main

    return sft_main(argv)


def _plot(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="openk2 plot", description="Write a run's PNG plots from metrics.jsonl")
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    from openk2.train.metrics import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0


def _serve(argv: list[str]) -> int:
    from openk2.infer.server import serve_main

    return serve_main(argv)


def _synth(argv: list[str]) -> int:
    from openk2.agentic.synth_cli import synth_main

    return synth_main(argv)


def _sandbox(argv: list[str]) -> int:
    from openk2.agentic.sandbox_service import sandbox_main

    return sandbox_main(argv)


def _rl(argv: list[str]) -> int:
    from openk2.rl.trainer import rl_main

    return rl_main(argv)


def _rl_tasks(argv: list[str]) -> int:
    from openk2.rl.tasks.cli import rl_tasks_main

    return rl_tasks_main(argv)


def _experiment(argv: list[str]) -> int:
    from openk2.experiments.cli import experiment_main

    return experiment_main(argv)


def _rephrase(argv: list[str]) -> int:
    from openk2.data.rephrase import rephrase_main

    return rephrase_main(argv)


def _eval(argv: list[str]) -> int:
    from openk2.eval.cli import eval_main

    return eval_main(argv)


def _redteam(argv: list[str]) -> int:
    from openk2.eval.redteam.cli import redteam_main

    return redteam_main(argv)


def _pipeline(argv: list[str]) -> int:
    from openk2.pipeline.cli import pipeline_main

    return pipeline_main(argv)


def _chat(argv: list[str]) -> int:
    from openk2.llm.chat_cli import chat_main

    return chat_main(argv)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "params": (_params, "parameter counts of a preset or HF config"),
    "tokenizer": (_tokenizer, "train a byte-level BPE tokenizer with K2's special tokens"),
    "pretrain": (_pretrain, "pre-train with MuonClip on the shipped corpus (configs/tiny.toml)"),
    "sft": (_sft, "supervised fine-tuning on chat/tool-use conversations (configs/sft-tiny.toml)"),
    "plot": (_plot, "write a run's loss, max-logit and expert-load plots"),
    "rephrase": (_rephrase, "rewrite a JSONL/Parquet corpus in several styles with an LLM, fidelity-checked"),
    "synth": (_synth, "agentic tool-use data synthesis: `synth tools` (repository), `synth run` (SFT data)"),
    "chat": (_chat, "terminal chat with any model spec (local:PATH, hf:smollm2, openai:URL#model)"),
    "experiment": (_experiment, "re-measure the report's pre-training claims at small scale (list, NAME --quick)"),
    "serve": (_serve, "OpenAI-compatible chat server for a checkpoint (127.0.0.1 by default)"),
    "rl": (_rl, "colocated RL with partial rollout on a verifiable task (configs/rl-tiny.toml)"),
    "rl-tasks": (_rl_tasks, "the verifiable RL tasks: `rl-tasks list`, `sample NAME`, `check NAME RESPONSE`"),
    "eval": (_eval, "score a model on benchmarks (tau2, BFCL, HumanEval, math, ...): `eval --list`, `eval compare`"),
    "redteam": (_redteam, "safety red-team: plugin x strategy pass rates with attacker and judge models"),
    "pipeline": (_pipeline, "tokenizer -> pretrain -> SFT -> RL, evaluated after each, and a report"),
    "sandbox": (_sandbox, "code-execution sandbox service: `sandbox serve` (POST /run, bearer token)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: openk2 <command> [options]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<12}{help_text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"openk2: unknown command {name!r}; run `openk2 --help`", file=sys.stderr)
        return 2
    try:
        return COMMANDS[name][0](rest)
    except ValueError as err:  # user errors: one clear line, no traceback
        print(f"openk2 {name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
