"""`openk2 experiment list` and `openk2 experiment NAME [--quick|--full] [--seed S] [--seeds N] [--out-dir DIR]`."""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path
from types import ModuleType

from openk2.experiments import EXPERIMENTS
from openk2.experiments.common import DEFAULT_RUNS_DIR, command_line
from openk2.experiments.seeds import run_seeds


def load_experiment(name: str) -> ModuleType:
    """The module of a registered experiment; ValueError names the known ones."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; known: {', '.join(EXPERIMENTS)} (see `openk2 experiment list`)")
    return importlib.import_module(EXPERIMENTS[name])


def default_out_dir(runs_dir: Path, name: str, mode: str, seed: int, seeds: int = 1, scale: float = 1.0) -> Path:
    """`NAME-MODE[-xSCALE]-seedS` (or `-seedsA-B`): the scale is in the name because finished runs in a directory
    are reused, and a run at another budget must not pick up these."""
    budget = mode if scale == 1.0 else f"{mode}-x{scale:g}"
    if seeds > 1:
        return runs_dir / f"{name}-{budget}-seeds{seed}-{seed + seeds - 1}"
    return runs_dir / f"{name}-{budget}-seed{seed}"


def find_reports(runs_dir: Path) -> list[tuple[Path, str]]:
    """(report path, its title) for every run directory under `runs_dir` that holds a report.md."""
    found = []
    for report in sorted(runs_dir.glob("*/report.md")):
        first = report.read_text(errors="replace").splitlines()[:1]
        title = first[0].lstrip("# ").strip() if first else ""
        found.append((report, title))
    return found


def list_experiments(runs_dir: Path) -> str:
    lines = ["experiments:"]
    for name in EXPERIMENTS:
        try:
            description = load_experiment(name).DESCRIPTION
        except ImportError as err:  # one broken module must not hide the others
            description = f"(cannot be imported: {err})"
        lines.append(f"  {name:<20}{description}")
    reports = find_reports(runs_dir)
    lines += ["", f"runs under {runs_dir}:" if reports else f"no runs under {runs_dir} yet"]
    lines += [f"  {report}  {title}" for report, title in reports]
    return "\n".join(lines)


def experiment_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="openk2 experiment",
        description="Re-measure the K2 report's pre-training claims at small scale. `openk2 experiment list` "
                    "shows the experiments and the reports already written.",
    )
    parser.add_argument("name", help=f"'list' or one of: {', '.join(EXPERIMENTS)}")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="the small budget (default): about 15 minutes on 2 quiet CPU cores")
    size.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="a budget several times larger, for a GPU or a long CPU session")
    parser.add_argument("--seed", type=int, default=0, help="initialisation (and synthetic-data) seed")
    parser.add_argument("--seeds", type=int, default=1,
                        help="run seeds SEED .. SEED+N-1 (each into OUT/seed<S>/) and write OUT/report.md with "
                             "means and 95%% confidence intervals")
    parser.add_argument("--out-dir", type=Path, help="run directory (default: RUNS_DIR/NAME-MODE-seedS)")
    parser.add_argument("--runs-dir", type=Path, default=DEFAULT_RUNS_DIR,
                        help=f"where runs go and where `list` looks (default: {DEFAULT_RUNS_DIR})")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the budget's steps (e.g. 0.5 for a reduced run on a busy machine); "
                             "the report's title and command record it")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default); 1 is much faster on an oversubscribed CPU")
    parser.set_defaults(mode="quick")
    args = parser.parse_args(argv)
    if args.name == "list":
        print(list_experiments(args.runs_dir))
        return 0
    module = load_experiment(args.name)
    if args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {args.seeds}")
    out_dir = args.out_dir or default_out_dir(args.runs_dir, args.name, args.mode, args.seed, args.seeds,
                                                args.scale)
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    kwargs = {}
    if args.scale != 1.0:
        if "scale" not in inspect.signature(module.run).parameters:
            raise ValueError(f"experiment {args.name!r} does not support --scale")
        kwargs["scale"] = args.scale
    try:
        if args.seeds > 1:
            command = command_line(args.name, args.mode, args.seed, out_dir, args.scale).replace(
                f" --seed {args.seed}", f" --seed {args.seed} --seeds {args.seeds}")
            report = run_seeds(module, args.name, out_dir, args.mode,
                               list(range(args.seed, args.seed + args.seeds)), kwargs, command)
        else:
            report = module.run(out_dir, args.mode, args.seed, **kwargs)
    except KeyboardInterrupt as err:
        print(f"\nopenk2 experiment: stopped ({err or 'interrupted'}); finished arms in {out_dir} are reused when "
              "the same command runs again", file=sys.stderr)
        return 130
    print(f"\nreport: {report}")
    print(Path(report).read_text().split("## Conclusion", 1)[-1].split("##", 1)[0].strip())
    return 0
