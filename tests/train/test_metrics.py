"""Metrics JSONL, resume truncation and the run plots."""

import json

from openk2.train.metrics import MetricsLogger, plot_run, read_metrics


def _log_steps(logger, steps):
    for s in steps:
        logger.log({"step": s, "loss": 5.0 / s, "max_logit_per_layer": [s * 1.0, s * 2.0], "qk_clip_tau": 100.0,
                    "expert_load": [[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]]})


def test_resume_drops_records_after_the_checkpoint(tmp_path):
    logger = MetricsLogger(tmp_path)
    _log_steps(logger, range(1, 11))
    logger.close()
    logger = MetricsLogger(tmp_path, resume_step=6)
    _log_steps(logger, range(7, 9))
    logger.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6, 7, 8]
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 9, "lo')  # torn line from a crash
    assert len(read_metrics(tmp_path)) == 8


def test_plots_are_written(tmp_path):
    logger = MetricsLogger(tmp_path)
    _log_steps(logger, range(1, 6))
    logger.log({"step": 5, "val_loss": 1.0, "unigram_val_loss": 2.0})
    logger.close()
    written = plot_run(tmp_path)
    assert sorted(p.name for p in written) == ["expert_load.png", "loss.png", "max_logit.png"]
    assert all(p.stat().st_size > 5000 for p in written)


def test_fresh_start_keeps_earlier_metrics_aside(tmp_path, capsys):
    """A run restarted from scratch in a used directory (e.g. every checkpoint corrupt) loses no records."""
    first = MetricsLogger(tmp_path)
    first.log({"step": 1, "loss": 2.0})
    first.close()
    second = MetricsLogger(tmp_path)
    second.log({"step": 1, "loss": 3.0})
    second.close()
    assert "earlier metrics kept as metrics.previous-1.jsonl" in capsys.readouterr().err
    assert [r["loss"] for r in read_metrics(tmp_path)] == [3.0]
    kept = (tmp_path / "metrics.previous-1.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in kept] == [2.0]
    MetricsLogger(tmp_path).close()
    assert (tmp_path / "metrics.previous-2.jsonl").is_file()
