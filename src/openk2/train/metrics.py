"""Run metrics: one JSON line per logged step (`metrics.jsonl`), optional TensorBoard, and the run's plots
(loss curve, per-layer max attention logit as in the K2 report's Figures 2-3, the share of heads QK-Clip clipped
and the heads ever clipped (Figure 3 / Appendix D), expert-load heatmap)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from openk2.fileio import atomic_write_text

METRICS_FILE = "metrics.jsonl"


def _free_name(path: Path) -> Path:
    """`metrics.jsonl` -> the first free `metrics.previous-N.jsonl` beside it."""
    n = 1
    while (candidate := path.with_name(f"{path.stem}.previous-{n}{path.suffix}")).exists():
        n += 1
    return candidate


class MetricsLogger:
    """Appends records to `run_dir/metrics.jsonl`; on resume, drops records past the resumed step."""

    def __init__(self, run_dir: str | Path, resume_step: int | None = None, tensorboard: bool = False) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.is_file():
            kept = [r for r in read_metrics(self.path.parent) if r.get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        elif resume_step is None and self.path.is_file():
            # A fresh start in a used directory (no checkpoint to resume, or none that verifies): the old records
            # are moved aside, never deleted, so a run whose checkpoints were all corrupt keeps its history.
            kept_as = _free_name(self.path)
            self.path.rename(kept_as)
            print(f"warning: starting a new run in {self.path.parent}; earlier metrics kept as {kept_as.name}",
                  file=sys.stderr)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.path.parent / "tensorboard"))
            except ImportError:
                print("warning: tensorboard is not installed; logging to metrics.jsonl only", file=sys.stderr)

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (must hold `step`); lists are kept in the JSONL, scalars also go to TensorBoard."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key != "step" and math.isfinite(value):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run (a torn last line from a crash is ignored)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"no {METRICS_FILE} in {run_dir}")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[Any]]:
    rows = [(r["step"], r[key]) for r in records if key in r]
    return [s for s, _ in rows], [v for _, v in rows]


def clip_summary(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A run's QK-Clip activity from its logged records (their `window_*` fields cover every step): heads ever
    clipped, steps with any clipping, first and last clipped step, the run's last step; None if not logged."""
    windows = [r for r in records if "window_clipped_heads" in r]
    if not windows:
        return None
    heads = {tuple(h) for r in windows for h in r["window_clipped_heads"]}
    steps = sorted({s for r in windows for s in r["window_clip_steps"]})
    return {"heads_ever_clipped": len(heads), "clip_steps": len(steps), "first_clip_step": steps[0] if steps else None,
            "last_clip_step": steps[-1] if steps else None, "last_step": max(r["step"] for r in records)}


def _plot_clipping(records: list[dict[str, Any]], path: Path, plt) -> Path | None:
    """qk_clip.png: the share of heads clipped per logged step, and the heads ever clipped so far."""
    steps, share = _series(records, "clipped_share")
    summary = clip_summary(records)
    if not steps or summary is None:
        return None
    ever, seen = [], set()
    wsteps = [r["step"] for r in records if "window_clipped_heads" in r]
    for r in records:
        if "window_clipped_heads" in r:
            seen.update(tuple(h) for h in r["window_clipped_heads"])
            ever.append(len(seen))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [100 * x for x in share], lw=1)
    ax1.set(xlabel="step", ylabel="heads clipped (%)", title="Share of heads clipped (logged steps)")
    ax2.step(wsteps, ever, where="post", lw=1)
    last = summary["last_clip_step"]
    if last is not None:
        ax2.axvline(last, color="red", ls="--", label=f"last clip at step {last} "
                    f"({last / summary['last_step']:.0%} of the run)")
        ax2.legend(fontsize=8)
    ax2.set(xlabel="step", ylabel="heads", title=f"Heads ever clipped ({summary['heads_ever_clipped']})")
    return _save(fig, path)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write loss.png, max_logit.png, qk_clip.png and expert_load.png into the run directory (those whose
    metrics were logged); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    written: list[Path] = []

    steps, loss = _series(records, "loss")
    if steps:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, loss, label="train loss", lw=1)
        vsteps, vloss = _series(records, "val_loss")
        if vsteps:
            ax.plot(vsteps, vloss, "o-", label="validation loss")
        usteps, unigram = _series(records, "unigram_val_loss")
        if unigram:
            ax.axhline(unigram[-1], color="gray", ls="--", label=f"unigram baseline ({unigram[-1]:.2f})")
        ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="Loss")
        ax.legend()
        written.append(_save(fig, run_dir / "loss.png"))

    steps, max_logits = _series(records, "max_logit_per_layer")
    if steps:
        fig, ax = plt.subplots(figsize=(7, 4))
        per_layer = list(zip(*max_logits, strict=True))
        for i, values in enumerate(per_layer):
            ax.plot(steps, values, lw=1, label=f"layer {i}")
        tsteps, tau = _series(records, "qk_clip_tau")
        if tau:
            ax.axhline(tau[-1], color="red", ls="--", label=f"tau = {tau[-1]:g}")
        ax.set(xlabel="step", ylabel="max attention logit", title="Max logit per layer (max over heads)")
        ax.legend(fontsize=7, ncol=2)
        written.append(_save(fig, run_dir / "max_logit.png"))

    clip_png = _plot_clipping(records, run_dir / "qk_clip.png", plt)
    if clip_png is not None:
        written.append(clip_png)

    steps, loads = _series(records, "expert_load")
    if steps:
        import numpy as np

        load = np.asarray(loads[-1], dtype=float)  # [moe layers, experts], fraction of routed slots
        imbalance = np.asarray([[max(row) * len(row) for row in snapshot] for snapshot in loads])
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        im = ax1.imshow(load, aspect="auto", cmap="viridis")
        ax1.set(xlabel="expert", ylabel="MoE layer", title=f"Expert load at step {steps[-1]} (share of tokens)",
                yticks=range(load.shape[0]))
        fig.colorbar(im, ax=ax1)
        for i in range(imbalance.shape[1]):
            ax2.plot(steps, imbalance[:, i], lw=1, label=f"MoE layer {i}")
        ax2.axhline(1.0, color="gray", ls="--")
        ax2.set(xlabel="step", ylabel="max load / mean load", title="Expert load imbalance")
        ax2.legend(fontsize=7)
        written.append(_save(fig, run_dir / "expert_load.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
