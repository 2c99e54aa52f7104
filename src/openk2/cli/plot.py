"""`openk2 plot RUN_DIR`: write a run's PNG plots (loss, max logit, expert load) from its metrics.jsonl."""

from __future__ import annotations

import argparse

from openk2.train.metrics import plot_run


def plot_main(argv: list[str] | None = None) -> int:
    """Write the plots and print their paths."""
    parser = argparse.ArgumentParser(prog="openk2 plot", description="Write a run's PNG plots from metrics.jsonl")
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    for path in plot_run(args.run_dir):
        print(path)
    return 0
