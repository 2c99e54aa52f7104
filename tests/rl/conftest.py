"""Shared setup of the `openk2 rl` end-to-end tests (test_tool_loop.py, test_retail_loop.py): a mixture config over
a shipped base file, the micro model and budgets of test_trainer.py's MICRO, a run directory, and the CLI run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class MicroRun:
    """An `openk2 rl` run of a mixture config shrunk to seconds."""

    config: Path  # the mixture's TOML (its `base =` is the shipped config)
    overrides: list[str]  # MICRO and the test's own `--set` values
    out: Path  # the run directory

    def cli(self, max_iterations: int) -> list[dict]:
        """Run `openk2 rl` for `max_iterations` iterations; the run directory's metrics records."""
        from openk2.cli.rl import rl_main
        from openk2.train.metrics import read_metrics

        args = ["--config", str(self.config), "--out-dir", str(self.out)]
        args += [a for m in self.overrides for a in ("--set", m)]
        assert rl_main([*args, "--max-iterations", str(max_iterations)]) == 0
        return read_metrics(self.out)


@pytest.fixture
def micro_rl_run(tmp_path: Path) -> Callable[[Path, str, Sequence[str]], MicroRun]:
    """make(base, envs, extra): a MicroRun whose config inherits `base` and adds the TOML `envs` (its [[envs]]
    tables), run with MICRO and `extra` overrides in tmp_path/run."""
    from tests.rl.test_trainer import MICRO

    def make(base: Path, envs: str, extra: Sequence[str]) -> MicroRun:
        config = tmp_path / "mixture.toml"
        config.write_text(f'base = "{base.as_posix()}"\n{envs}')
        return MicroRun(config, [*MICRO, *extra], tmp_path / "run")

    return make
