"""progress_bar: tqdm on a terminal; off one (a log file, a pipe), flushed plain lines with no carriage return."""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

from openk2 import progress
from openk2.progress import LineProgress, progress_bar


def test_line_progress_prints_start_throttled_updates_and_end_once():
    out = io.StringIO()
    bar = LineProgress(10, "eval", "sample", initial=2, every_s=3600.0, file=out)
    for _ in range(8):
        bar.update(1)  # inside the interval: no line
    bar.set_postfix(mean="0.250")
    bar.close()
    bar.close()  # a second close prints nothing
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue()
    assert lines[0].startswith("eval: 2/10 samples (") and lines[1].startswith("eval: 10/10 samples (mean=0.250, ")


def test_line_progress_prints_again_after_its_interval(monkeypatch):
    clock = iter([0.0, 0.0, 10.0, 31.0, 31.0, 40.0])  # start and its line; each update; a line when printed
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    out = io.StringIO()
    bar = LineProgress(3, "rl", "step", every_s=30.0, file=out)  # line 1
    bar.update()  # 10 s: quiet
    bar.update()  # 31 s: line 2
    bar.update()  # 40 s: quiet (9 s since the last line)
    assert out.getvalue().splitlines() == ["rl: 0/3 steps (0 s)", "rl: 2/3 steps (31 s)"]


def test_line_progress_does_not_repeat_its_last_line_on_close():
    out = io.StringIO()
    bar = LineProgress(2, "e", "item", every_s=0.0, file=out)  # a line on every update
    bar.update(2)
    bar.close()
    assert out.getvalue().splitlines()[1:] == ["e: 2/2 items (0 s)"]


def test_progress_bar_picks_lines_off_a_terminal_and_tqdm_on_one(monkeypatch):
    piped = io.StringIO()
    monkeypatch.setattr(progress.sys, "stderr", piped)
    assert isinstance(progress_bar(5, "x", "item"), LineProgress)
    assert piped.getvalue() == "x: 0/5 items (0 s)\n"

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(progress.sys, "stderr", Terminal())
    bar = progress_bar(5, "x", "item", leave=False)
    assert isinstance(bar, tqdm) and not bar.disable
    bar.close()
    silent = progress_bar(5, "x", "item", enabled=False)
    assert isinstance(silent, tqdm) and silent.disable


@pytest.mark.parametrize("total", [0, 1])
def test_line_progress_handles_tiny_totals(total):
    out = io.StringIO()
    bar = LineProgress(total, "t", "item", file=out)
    bar.update(total)
    bar.close()
    assert out.getvalue().splitlines()[-1].startswith(f"t: {total}/{total} items")
