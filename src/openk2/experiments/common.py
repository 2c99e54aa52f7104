"""Shared pieces of the small-scale experiments: the base run config, in-process training runs that yield
validation loss against tokens (cached per arm, so a crashed experiment resumes at the next arm), the token
efficiency read off two curves, plots and the report file."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from openk2.progress import progress_bar
from openk2.train.config import RunConfig
from openk2.train.metrics import read_metrics

T = TypeVar("T")
MODES = ("quick", "full")
CURVE_FILE = "curve.json"
RESULTS_FILE = "results.json"
DEFAULT_RUNS_DIR = Path("runs/experiments")

# The experiments' base model: K2's structure (MLA with low-rank q and kv and decoupled rope, one dense layer
# then MoE layers with a shared expert, sigmoid routing) at toy width: a 4096-token step is ~2 CPU-seconds.
BASE_MODEL: dict[str, Any] = {
    "preset": "tiny", "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 384, "moe_intermediate_size": 64,
    "num_hidden_layers": 3, "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 16,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
}
TOKENIZER_TRAIN_CHARS = 2_000_000
# The micro budget (tests): a model and corpus small enough that an arm takes seconds.
MICRO_MODEL: dict[str, Any] = {"vocab_size": 768, "hidden_size": 32, "intermediate_size": 64,
                               "moe_intermediate_size": 16, "num_hidden_layers": 2, "q_lora_rank": 16,
                               "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8}
MICRO_DATA: dict[str, Any] = {"val_fraction": 0.05, "sources": [{"kind": "math", "weight": 1.0, "num_docs": 200}]}
MICRO_TOKENIZER_CHARS = 100_000


def base_run_config(runs_dir: Path, seed: int, steps: int, *, batch_size: int = 16, seq_len: int = 256,
                    eval_points: int = 8, eval_batches: int = 8, model: dict[str, Any] | None = None,
                    optim: dict[str, Any] | None = None, schedule: dict[str, Any] | None = None) -> dict[str, Any]:
    """A raw (TOML-shaped) run config on the shipped corpus: `seed` seeds the init and nothing else, so every
    arm of an experiment sees the same batches and the same validation tokens. The tokenizer and the token
    cache are shared by all experiments under `runs_dir/_shared`."""
    base, data = dict(BASE_MODEL), {}
    if micro_budget():
        base, data = {**base, **MICRO_MODEL}, dict(MICRO_DATA)
    return {
        "out_dir": str(runs_dir),
        "model": {**base, **(model or {})},
        "tokenizer": {"path": str(runs_dir / "_shared" / f"tokenizer-{base['vocab_size']}")},
        "data": {"seq_len": seq_len, "seed": 0, "cache_dir": str(runs_dir / "_shared" / "cache"), **data},
        "optim": {"lr": 3e-3, "weight_decay": 0.1, **(optim or {})},
        "schedule": {"warmup_steps": max(1, steps // 20), "decay_fraction": 0.2, **(schedule or {})},
        "train": {"steps": steps, "batch_size": batch_size, "seed": seed, "log_every": max(1, steps // 50),
                  "eval_every": max(2, steps // eval_points), "eval_batches": eval_batches,
                  "checkpoint_every": steps, "keep_checkpoints": 1},
    }


def ensure_tokenizer(raw: dict[str, Any]) -> None:
    """Train the experiments' shared BPE tokenizer once (into raw's tokenizer.path) if it is not there yet."""
    path = Path(raw["tokenizer"]["path"])
    if (path / "tokenizer.json").is_file():
        return
    from openk2.data.corpus import CorpusConfig, tokenizer_training_texts
    from openk2.data.tokenizer import train_tokenizer

    data = {k: v for k, v in raw["data"].items() if k not in ("seq_len", "cache_dir")}
    chars = MICRO_TOKENIZER_CHARS if micro_budget() else TOKENIZER_TRAIN_CHARS
    texts = tokenizer_training_texts(CorpusConfig.from_dict(copy.deepcopy(data)), chars)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    train_tokenizer(texts, raw["model"]["vocab_size"]).save(tmp)
    if (path / "tokenizer.json").is_file():  # another process won the race; its tokenizer is the same
        shutil.rmtree(tmp)
    else:
        tmp.replace(path)


@dataclass
class Curve:
    """One training arm: validation loss against tokens seen, plus what the run cost."""

    label: str
    tokens: list[int]
    val_loss: list[float]
    seconds: float
    tokens_per_s: float
    config: dict[str, Any]
    steps: list[int] = field(default_factory=list)  # step of each val point
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final_val_loss(self) -> float:
        return self.val_loss[-1]

    @classmethod
    def load(cls, path: Path) -> Curve:
        return cls(**json.loads(path.read_text()))

    def save(self, path: Path) -> None:
        write_atomic(path, json.dumps(asdict(self), indent=1))


def train_curve(raw: dict[str, Any], out_dir: Path, label: str) -> Curve:
    """Run one arm in-process with the Trainer and return its curve; an arm already finished with the same
    config (its curve.json) is read back instead of retrained."""
    from openk2.train.trainer import Trainer

    cached = out_dir / CURVE_FILE
    if cached.is_file():
        curve = Curve.load(cached)
        if curve.config == raw:
            return curve
    ensure_tokenizer(raw)
    cfg = RunConfig.from_dict(copy.deepcopy(raw))
    start = time.perf_counter()
    summary = Trainer(cfg, out_dir=out_dir).run()
    seconds = time.perf_counter() - start
    if summary.step < cfg.train.steps:  # stopped on a signal: no curve is cached, the experiment stops here
        raise KeyboardInterrupt(f"{label} stopped at step {summary.step} of {cfg.train.steps}")
    records = [r for r in read_metrics(out_dir) if "val_loss" in r]
    curve = Curve(label=label, tokens=[r["tokens_seen"] for r in records], val_loss=[r["val_loss"] for r in records],
                  steps=[r["step"] for r in records], seconds=seconds,
                  tokens_per_s=summary.step * cfg.train.batch_size * cfg.data.seq_len / seconds, config=raw,
                  extra={"unigram_val_loss": summary.unigram_val_loss})
    curve.save(cached)
    return curve


def tokens_to_reach(curve: Curve, target: float) -> float | None:
    """Tokens at which `curve` first reaches `target` (linear interpolation between val points); None if never."""
    prev_t, prev_l = 0.0, None
    for t, loss in zip(curve.tokens, curve.val_loss, strict=True):
        if loss <= target:
            if prev_l is None or prev_l == loss:
                return float(t)
            return prev_t + (prev_l - target) / (prev_l - loss) * (t - prev_t)
        prev_t, prev_l = float(t), loss
    return None


def plot_lines(path: Path, series: dict[str, tuple[list[float], list[float]]], *, xlabel: str, ylabel: str,
               title: str, hlines: dict[str, float] | None = None, logy: bool = False,
               styles: dict[str, str] | None = None) -> Path:
    """One PNG with a line per series (label -> (x, y)) and optional labelled horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, (x, y) in series.items():
        ax.plot(x, y, (styles or {}).get(label, "-"), label=label, lw=1.2, ms=3)
    for label, value in (hlines or {}).items():
        ax.axhline(value, color="gray", ls="--", lw=1, label=label)
    if logy:
        ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-style table; floats get 4 decimals unless already formatted."""

    def cell(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(out_dir: Path, *, title: str, setup: str, table: str, conclusion: str, command: str,
                 plots: list[Path], extra: str = "", metrics: dict[str, float] | None = None) -> Path:
    """report.md: setup, results table, one-paragraph conclusion, the plots and the command that made it; with
    `metrics`, also results.json (the headline numbers `--seeds N` aggregates)."""
    if metrics is not None:
        write_atomic(out_dir / RESULTS_FILE, json.dumps({"title": title, "command": command, "metrics": metrics},
                                                        indent=1))
    parts = [f"# {title}", "", "## Setup", "", setup.strip(), "", "## Results", "", table.strip(), ""]
    if extra:
        parts += [extra.strip(), ""]
    parts += ["## Conclusion", "", conclusion.strip(), ""]
    parts += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    parts += ["## Reproduce", "", "```", command, "```", ""]
    path = out_dir / "report.md"
    write_atomic(path, "\n".join(parts))
    return path


def write_atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a crash never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def command_line(name: str, mode: str, seed: int, out_dir: Path, scale: float = 1.0) -> str:
    scale_flag = f" --scale {scale:g}" if scale != 1.0 else ""
    return f"openk2 experiment {name} --{mode}{scale_flag} --seed {seed} --out-dir {out_dir}"


def mode_label(mode: str, scale: float) -> str:
    return mode if scale == 1.0 else f"{mode}, steps x{scale:g}"


def reduced_note(steps: int, mode: str, scale: float) -> str:
    """A sentence for the conclusion of a run whose budget was scaled down (empty for the real budget)."""
    if scale >= 1.0:
        return ""
    return (f" This was a reduced run ({steps} steps per arm, x{scale:g} of the {mode} budget, because the "
            "machine was busy): numbers this early in training say little about the claim.")


def scaled(budget: Any, scale: float) -> Any:
    """The budget with its step count multiplied by `scale` (a reduced run on a busy machine, say)."""
    if scale <= 0:
        raise ValueError(f"--scale must be positive, got {scale}")
    return dataclasses.replace(budget, steps=max(4, round(budget.steps * scale)))


def fmt_tokens(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def micro_budget() -> bool:
    """Tests set OPENK2_EXPERIMENT_MICRO=1 to shrink every experiment to seconds (plumbing only)."""
    return os.environ.get("OPENK2_EXPERIMENT_MICRO") == "1"


def median(values: list[float]) -> float:
    return float(np.median(values))


def run_arms(out_dir: Path, arms: dict[str, dict[str, Any]]) -> dict[str, Curve]:
    """Train each arm (label -> raw config) into its own sub-directory of `out_dir`, in order."""
    curves = {}
    for i, (label, raw) in enumerate(arms.items()):
        print(f"[{i + 1}/{len(arms)}] {label}", flush=True)
        curves[label] = train_curve(raw, out_dir / f"arm{i}-{slug(label)}", label)
    return curves


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in text.lower()).strip("-")


def throughput_note(curves: dict[str, Curve]) -> str:
    """One line on what the arms cost here: total tokens, wall time and the median tokens/s."""
    tokens = sum(c.tokens[-1] for c in curves.values() if c.tokens)
    seconds = sum(c.seconds for c in curves.values())
    rate = median([c.tokens_per_s for c in curves.values()])
    return (f"Cost on this machine: {fmt_tokens(tokens)} training tokens in {seconds / 60:.1f} min "
            f"(median {rate:,.0f} tokens/s per arm, validation included; the machine may have been shared).")


def progress(iterable: Iterable[T], label: str, every_s: float = 30.0) -> Iterator[T]:
    """`openk2.progress.progress_bar` over an iterable of steps: tqdm on a terminal, flushed lines otherwise."""
    items = list(iterable)
    bar = progress_bar(len(items), label, "step", every_s=every_s)
    for item in items:
        yield item
        bar.update()
    bar.close()
