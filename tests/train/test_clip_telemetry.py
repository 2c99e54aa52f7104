"""QK-Clip telemetry through a real training run: run-level counts from the logged records, the plot, the
probe cadence of a logging-only run."""

from openk2.train.config import RunConfig
from openk2.train.metrics import clip_summary, read_metrics
from openk2.train.trainer import Trainer


def test_run_logs_every_clipped_step_and_plots_it(micro_raw, tmp_path):
    micro_raw["optim"]["qk_clip_tau"] = 0.08  # this micro model passes 0.08 within a few steps (test_trainer)
    micro_raw["train"].update(steps=9, log_every=3)
    every_step = []
    trainer = Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "r")
    step = trainer.optimizer.step

    def spy(max_logits=None):
        clip = step(max_logits)
        every_step.append(clip.num_clipped)
        return clip

    trainer.optimizer.step = spy
    trainer.run()
    records = [r for r in read_metrics(tmp_path / "r") if "loss" in r]
    assert [r["step"] for r in records] == [3, 6, 9]
    summary = clip_summary(records)
    clipped_steps = [i + 1 for i, n in enumerate(every_step) if n > 0]
    assert clipped_steps, "tau=0.08 should clip in this run"
    assert summary["clip_steps"] == len(clipped_steps)  # unlogged steps included
    assert summary["first_clip_step"] == clipped_steps[0] and summary["last_clip_step"] == clipped_steps[-1]
    assert summary["heads_ever_clipped"] >= max(every_step)
    assert all(0 <= r["clipped_share"] <= 1 and len(r["clipped_heads_per_layer"]) == 2 for r in records)
    assert (tmp_path / "r" / "qk_clip.png").is_file()


def test_logging_only_run_probes_at_its_cadence(micro_raw, tmp_path):
    micro_raw["optim"].update(qk_clip_tau=0.0, max_logit_every=3)
    micro_raw["train"].update(steps=6, eval_every=6, checkpoint_every=6)
    Trainer(RunConfig.from_dict(micro_raw), out_dir=tmp_path / "r").run()
    records = [r for r in read_metrics(tmp_path / "r") if "loss" in r]
    assert [r["step"] for r in records if "max_logit" in r] == [3, 6]
    assert all(len(r["max_logit_per_layer"]) == 2 for r in records if "max_logit" in r)
    assert all(r["clipped_heads"] == 0 for r in records)
