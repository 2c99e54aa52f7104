"""`long-context`: K2's recipe in miniature: pre-train at a short length L with plain RoPE, then extend to 4L,
with and without YaRN, and measure passkey retrieval and loss by position at L, 2L and 4L.

Task (synthetic, so that retrieval is measurable at toy scale): rows of "filler" drawn from a fixed sparse
Markov chain (a toy language with per-token entropy well below log V), with a needle KEY d1..dm (m distinct
random symbols) at a random depth and, at the end, KEY d1..dm again: predicting the symbols after the second KEY
needs attention back to the needle (an induction head's copy), at a distance up to the row length. Arms, all
from one base model pre-trained at L:
  (a) no extension: the base model, plain RoPE;
  (b) YaRN x4 applied without training (zero-shot);
  (c) extension without YaRN: a short stage at 4L with plain RoPE;
  (d) extension with YaRN: the same stage with YaRN x4 over L switched on (K2's mscale settings, so the softmax
      scale grows by mscale(4)^2 = 1.29 and QK-Clip's tau with it, as openk2.train.stages does).
The switch is `openk2.train.stages.apply_model_config`, the trainer's own. The loop is written out here, like
qk-clip's, because the Trainer reads the text corpus; the components are the Trainer's (K2ForCausalLM, MuonClip,
the WSD schedule, the stage switch).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from openk2.config import ModelConfig
from openk2.experiments.common import (
    check_mode,
    command_line,
    markdown_table,
    micro_budget,
    mode_label,
    plot_lines,
    progress,
    reduced_note,
    scaled,
    write_atomic,
    write_report,
)
from openk2.model import ForwardStats, K2ForCausalLM
from openk2.model.rope import softmax_scale
from openk2.optim.muonclip import MuonClip
from openk2.optim.schedule import WSDConfig, wsd_lr
from openk2.rng import seed_everything
from openk2.train.config import StageSection
from openk2.train.stages import apply_model_config, stage_model_config

DESCRIPTION = "context extension to 4x: none vs plain RoPE vs YaRN; passkey retrieval and loss by position at 1x-4x"

# Dense MLA (q/k 16 + 16 rope, v 32, kv latent 64), 2 layers: attention is what the experiment is about.
LC_MODEL: dict[str, Any] = {
    "vocab_size": 64, "hidden_size": 128, "intermediate_size": 384, "moe_intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 64,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 4,
    "n_shared_experts": 0, "num_experts_per_tok": 1, "first_k_dense_replace": 2, "rope_theta": 10000.0,
    "rope_scaling": None,
}
EXTENSION = 4
# K2's released YaRN keys except the factor and length (beta_fast/slow at YaRN's defaults 32/1: K2's 1/1 make
# a step instead of a ramp, which at a 16-dim rotary part leaves no pair in between).
YARN: dict[str, Any] = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
ARMS = ("no extension", "YaRN x4, no training", "extended, plain RoPE", "extended, YaRN x4")


@dataclass(frozen=True)
class PasskeyTask:
    """Markov filler over tokens [0, filler), key symbols [filler, filler + symbols), then the KEY marker."""

    filler: int = 32
    symbols: int = 32  # the needle's alphabet; a needle's symbols are distinct, so copying it is unambiguous
    digits: int = 24  # needle length m
    successors: int = 3  # non-zero transitions per filler token
    chain_seed: int = 1234  # the toy language: the same for every run

    @property
    def key(self) -> int:
        return self.filler + self.symbols

    @property
    def vocab(self) -> int:
        return self.filler + self.symbols + 1

    def transitions(self) -> torch.Tensor:
        """[filler, filler] row-stochastic matrix: each token has `successors` successors, weights 6:3:1."""
        g = torch.Generator().manual_seed(self.chain_seed)
        probs = torch.zeros(self.filler, self.filler)
        weights = torch.tensor([6.0, 3.0, 1.0, 1.0, 1.0][: self.successors])
        for i in range(self.filler):
            probs[i, torch.randperm(self.filler, generator=g)[: self.successors]] = weights / weights.sum()
        return probs

    def filler_entropy(self) -> float:
        """Per-token entropy of the filler chain (nats): the loss floor on filler tokens."""
        p = self.transitions()
        return float(-(p[p > 0] * p[p > 0].log()).sum() / self.filler)

    def batch(self, rows: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [rows, length], filler mask [rows, length]: True where the token is filler)."""
        m = self.digits
        if length < 2 * (m + 1) + 2:
            raise ValueError(f"rows of {length} tokens cannot hold a needle and its copy of {m} symbols")
        probs = self.transitions()
        ids = torch.empty(rows, length, dtype=torch.long)
        ids[:, 0] = torch.randint(0, self.filler, (rows,), generator=generator)
        for t in range(1, length):
            ids[:, t] = torch.multinomial(probs[ids[:, t - 1]], 1, generator=generator).squeeze(1)
        if m > self.symbols:
            raise ValueError(f"a needle of {m} distinct symbols needs at least {m} symbols, got {self.symbols}")
        order = torch.rand(rows, self.symbols, generator=generator).argsort(dim=1)
        digits = self.filler + order[:, :m]
        depth = torch.randint(0, length - 2 * (m + 1), (rows,), generator=generator)
        filler = torch.ones(rows, length, dtype=torch.bool)
        for r in range(rows):
            p = int(depth[r])
            ids[r, p] = self.key
            ids[r, p + 1 : p + 1 + m] = digits[r]
            filler[r, p : p + 1 + m] = False
        ids[:, length - m - 1] = self.key
        ids[:, length - m :] = digits
        filler[:, length - m - 1 :] = False
        return ids, filler


@dataclass(frozen=True)
class Budget:
    base_steps: int  # pre-training at the short length
    extend_steps: int  # the long-context stage
    short_len: int
    batch_size: int  # rows per step at the short length; the long stage uses batch_size / 4 (same tokens)
    lr: float
    eval_rows: int
    needle: int  # symbols per needle (PasskeyTask.digits)


BUDGETS = {
    "quick": Budget(base_steps=800, extend_steps=100, short_len=64, batch_size=32, lr=0.03, eval_rows=128,
                    needle=24),
    "full": Budget(base_steps=3200, extend_steps=400, short_len=64, batch_size=32, lr=0.03, eval_rows=512,
                   needle=24),
    "micro": Budget(base_steps=6, extend_steps=3, short_len=16, batch_size=8, lr=0.03, eval_rows=8, needle=4),
}
TAU = 100.0


@dataclass(frozen=True)
class _Steps:
    steps: int


def budget_steps(budget: Budget) -> _Steps:
    """The budget's pre-training steps in the shape `common.scaled` scales."""
    return _Steps(budget.base_steps)


def _model_config(budget: Budget, task: PasskeyTask) -> ModelConfig:
    cfg = {**LC_MODEL, "vocab_size": task.vocab, "max_position_embeddings": budget.short_len}
    return ModelConfig.preset("tiny").replace(**cfg)


def _train(model: K2ForCausalLM, optimizer: MuonClip, task: PasskeyTask, steps: int, length: int, rows: int,
           lr_at, generator: torch.Generator, label: str) -> list[float]:
    losses = []
    for step in progress(range(steps), label):
        optimizer.set_lr(lr_at(step))
        ids, _ = task.batch(rows, length, generator)
        stats = ForwardStats(model.config, track_max_logits=True)
        loss = model(ids, labels=ids, stats=stats).loss
        loss.backward()
        optimizer.step(stats.max_logits())
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _switch(model: K2ForCausalLM, optimizer: MuonClip, base: ModelConfig, rope: str, length: int) -> None:
    """The trainer's stage switch: RoPE (plain or YaRN x4 over the short length), length, tau scaled."""
    yarn = {**YARN, "factor": float(EXTENSION), "original_max_position_embeddings": base.max_position_embeddings}
    section = StageSection(name=rope, steps=1, rope=rope, yarn=yarn if rope == "yarn" else {},
                           max_position_embeddings=length)
    cfg = stage_model_config(base, section)
    apply_model_config(model, cfg)
    optimizer.tau = optimizer.qk_clip.tau = TAU * softmax_scale(cfg) / softmax_scale(base)


@torch.no_grad()
def evaluate(model: K2ForCausalLM, task: PasskeyTask, lengths: list[int], rows: int, seed: int,
             bin_size: int) -> dict[str, Any]:
    """Per length: passkey accuracy (all symbols right, teacher-forced argmax), symbol accuracy, filler loss; and
    the filler loss by position (bins of `bin_size`) at the longest length."""
    model.eval()
    out: dict[str, Any] = {"lengths": lengths, "passkey": [], "digit": [], "filler_loss": []}
    m = task.digits
    for length in lengths:
        ids, filler = task.batch(rows, length, torch.Generator().manual_seed(50_000 + 7 * seed + length))
        logits = model(ids).logits.float()
        predicted = logits[:, length - m - 1 : length - 1].argmax(-1)
        right = predicted == ids[:, length - m :]
        out["passkey"].append(float(right.all(dim=1).float().mean()))
        out["digit"].append(float(right.float().mean()))
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        mask = filler[:, 1:]
        out["filler_loss"].append(float(ce[mask].mean()))
        if length == lengths[-1]:
            bins = [(lo, min(lo + bin_size, length - 1)) for lo in range(0, length - 1, bin_size)]
            out["position_bins"] = [lo + 1 for lo, _ in bins]
            out["loss_by_position"] = [float(ce[:, lo:hi][mask[:, lo:hi]].mean()) for lo, hi in bins]
    model.train()
    return out


def run_seed(budget: Budget, task: PasskeyTask, seed: int) -> dict[str, Any]:
    """The base model and the four arms for one seed: training losses, evaluations, seconds."""
    seed_everything(seed)
    base_cfg = _model_config(budget, task)
    model = K2ForCausalLM(base_cfg)
    optimizer = MuonClip(model, lr=budget.lr, weight_decay=0.1, tau=TAU, ns_dtype=torch.float32)
    warm, decay = max(1, budget.base_steps // 50), budget.base_steps // 5
    schedule = WSDConfig(peak_lr=budget.lr, warmup_steps=warm, stable_steps=budget.base_steps - warm - decay,
                         decay_steps=decay, decay_floor=budget.lr * 0.1)
    data = torch.Generator().manual_seed(seed)
    long_len = budget.short_len * EXTENSION
    lengths = [budget.short_len, 2 * budget.short_len, long_len]
    bin_size = max(4, budget.short_len // 4)
    start = time.perf_counter()
    base_losses = _train(model, optimizer, task, budget.base_steps, budget.short_len, budget.batch_size,
                         lambda s: wsd_lr(s, schedule), data, f"seed {seed}: pre-train at {budget.short_len}")
    results: dict[str, Any] = {"base_loss": base_losses, "base_seconds": time.perf_counter() - start, "arms": {}}
    results["arms"][ARMS[0]] = evaluate(model, task, lengths, budget.eval_rows, seed, bin_size)
    zero_shot = copy.deepcopy(model)
    apply_model_config(zero_shot, stage_model_config(base_cfg, StageSection(
        name="yarn", steps=0, rope="yarn", max_position_embeddings=long_len,
        yarn={**YARN, "factor": float(EXTENSION), "original_max_position_embeddings": budget.short_len})))
    results["arms"][ARMS[1]] = evaluate(zero_shot, task, lengths, budget.eval_rows, seed, bin_size)
    ext_lr = budget.lr * 0.1  # the decayed lr the base run ended at, held (K2's 32k stage: the anneal's floor)
    for arm, rope in ((ARMS[2], "plain"), (ARMS[3], "yarn")):
        arm_model, arm_opt = copy.deepcopy((model, optimizer))
        _switch(arm_model, arm_opt, base_cfg, rope, long_len)
        arm_data = torch.Generator().manual_seed(20_000 + seed)  # both extensions see the same long rows
        start = time.perf_counter()
        losses = _train(arm_model, arm_opt, task, budget.extend_steps, long_len,
                        max(1, budget.batch_size // EXTENSION), lambda s: ext_lr, arm_data, f"seed {seed}: {arm}")
        evaluation = evaluate(arm_model, task, lengths, budget.eval_rows, seed, bin_size)
        results["arms"][arm] = {**evaluation, "train_loss": losses, "seconds": time.perf_counter() - start,
                                "tau": arm_opt.tau}
    return results


def _seed_results(path: Path, budget: Budget, task: PasskeyTask, seed: int) -> dict[str, Any]:
    """One seed's results, read back from `path` when it holds the same setting, else trained and saved."""
    key = json.loads(json.dumps({"task": asdict(task), "budget": asdict(budget), "seed": seed, "model": LC_MODEL,
                                 "yarn": YARN}))
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["results"]
    results = run_seed(budget, task, seed)
    write_atomic(path, json.dumps({"key": key, "results": results}))
    return results


def headline(results: dict[str, Any]) -> dict[str, float]:
    """The numbers a multi-seed summary aggregates: passkey accuracy and filler loss per arm and length."""
    out = {}
    for arm, ev in results["arms"].items():
        for i, factor in enumerate((1, 2, 4)):
            out[f"passkey acc @{factor}x, {arm}"] = ev["passkey"][i]
        for i, factor in enumerate((1, 2, 4)):
            out[f"symbol acc @{factor}x, {arm}"] = ev["digit"][i]
        for i, factor in enumerate((1, 2, 4)):
            out[f"filler loss @{factor}x, {arm}"] = ev["filler_loss"][i]
    return out


def run(out_dir: Path, mode: str, seed: int, scale: float = 1.0) -> Path:
    check_mode(mode)
    budget = BUDGETS["micro" if micro_budget() else mode]
    if scale != 1.0:
        steps = scaled(budget_steps(budget), scale).steps
        budget = dataclasses.replace(budget, base_steps=steps,
                                     extend_steps=max(2, round(budget.extend_steps * steps / budget.base_steps)))
    out_dir.mkdir(parents=True, exist_ok=True)
    task = PasskeyTask(digits=budget.needle)
    results = _seed_results(out_dir / "runs.json", budget, task, seed)
    arms = results["arms"]
    long_len = budget.short_len * EXTENSION
    lengths = [budget.short_len, 2 * budget.short_len, long_len]

    x = [float(v) for v in lengths]
    plots = [
        plot_lines(out_dir / "passkey.png", {arm: (x, ev["digit"]) for arm, ev in arms.items()},
                   xlabel="row length (tokens)", ylabel="symbol accuracy after the second KEY",
                   title=f"Passkey retrieval; pre-trained at {budget.short_len}",
                   styles=dict.fromkeys(arms, "o-")),
        plot_lines(out_dir / "loss_by_position.png",
                   {arm: ([float(b) for b in ev["position_bins"]], ev["loss_by_position"]) for arm, ev in arms.items()},
                   xlabel="position", ylabel="filler loss (nats/token)",
                   title=f"Loss by position in {long_len}-token rows (pre-trained at {budget.short_len})", logy=True,
                   hlines={f"filler entropy {task.filler_entropy():.3f}": task.filler_entropy()}),
    ]
    headers = ["arm"] + [f"passkey @{f}x ({n})" for f, n in zip((1, 2, 4), lengths, strict=True)] + [
        f"symbol acc @{f}x" for f in (1, 2, 4)] + [f"filler loss @{f}x" for f in (1, 2, 4)]
    rows = [[arm] + [f"{v:.3f}" for v in ev["passkey"] + ev["digit"] + ev["filler_loss"]]
            for arm, ev in arms.items()]
    table = markdown_table(headers, rows)
    ext_seconds = ", ".join(f"{arms[a]['seconds']:.0f} s" for a in ARMS[2:])
    table += (f"\n\nFiller entropy (the loss floor on filler tokens): {task.filler_entropy():.3f} nats. Chance "
              f"per-symbol accuracy: {1 / task.symbols:.3f}. Base run: final training loss "
              f"{sum(results['base_loss'][-20:]) / len(results['base_loss'][-20:]):.4f}, "
              f"{results['base_seconds']:.0f} s; each extension {budget.extend_steps} steps "
              f"({ext_seconds}); QK-Clip tau in the YaRN stage "
              f"{arms[ARMS[3]]['tau']:.1f} (100 x the softmax-scale ratio).")
    setup = (
        f"Task: rows of filler from a fixed sparse Markov chain over {task.filler} tokens ({task.successors} "
        f"successors each, weights 6:3:1), with a needle KEY d1..d{task.digits} at a uniform random depth and "
        f"KEY d1..d{task.digits} again at the end ({task.digits} distinct symbols of {task.symbols}). Model: our "
        f"MLA transformer, "
        f"{LC_MODEL['num_hidden_layers']} dense layers, width {LC_MODEL['hidden_size']}, "
        f"{LC_MODEL['num_attention_heads']} heads (q/k {LC_MODEL['qk_nope_head_dim']} + "
        f"{LC_MODEL['qk_rope_head_dim']} rope, v {LC_MODEL['v_head_dim']}), RoPE theta "
        f"{LC_MODEL['rope_theta']:g}. Pre-training: {budget.base_steps} steps at {budget.short_len} tokens, "
        f"batch {budget.batch_size}, MuonClip (lr {budget.lr}, weight decay 0.1, tau {TAU:g}), WSD (2% warm-up, "
        f"last 20% cosine to 0.1x). Extension stages: {budget.extend_steps} steps at {long_len} tokens, batch "
        f"{max(1, budget.batch_size // EXTENSION)} (the same tokens per step), lr held at the decayed "
        f"{budget.lr * 0.1:g}, both from the same base weights and optimizer state and on the same rows; YaRN: "
        f"factor {EXTENSION} over {budget.short_len}, beta {YARN['beta_fast']:g}/{YARN['beta_slow']:g}, mscale "
        f"{YARN['mscale']:g}, mscale_all_dim {YARN['mscale_all_dim']:g} (softmax scale x"
        f"{(0.1 * math.log(EXTENSION) + 1) ** 2:.3f}). Evaluation: {budget.eval_rows} held-out rows per length, "
        f"teacher-forced; passkey accuracy counts a row when every symbol after the second KEY is the argmax, "
        f"symbol accuracy counts symbols. Seed {seed} "
        f"(init and data).")
    conclusion = _conclusion(arms) + reduced_note(budget.base_steps, mode, scale)
    return write_report(out_dir, title=f"Context extension with YaRN ({mode_label(mode, scale)})", setup=setup,
                        table=table, conclusion=conclusion,
                        command=command_line("long-context", mode, seed, out_dir, scale), plots=plots,
                        metrics=headline(results))


def _conclusion(arms: dict[str, Any]) -> str:
    none, zero, plain, yarn = (arms[a] for a in ARMS)
    parts = [f"At the trained length the base model copies {none['digit'][0]:.0%} of needle symbols (whole needles: "
             f"{none['passkey'][0]:.0%}); at 4x it copies {none['digit'][2]:.0%} without extension and "
             f"{zero['digit'][2]:.0%} with YaRN applied untrained, and its filler loss at 4x is "
             f"{none['filler_loss'][2]:.3f} vs {zero['filler_loss'][2]:.3f} (at 1x {none['filler_loss'][0]:.3f})"]
    parts.append(f"after the short long-context stage, plain RoPE copies {plain['digit'][2]:.0%} at 4x and YaRN "
                 f"{yarn['digit'][2]:.0%} (filler loss at 4x {plain['filler_loss'][2]:.3f} vs "
                 f"{yarn['filler_loss'][2]:.3f}; at 1x {plain['filler_loss'][0]:.3f} vs {yarn['filler_loss'][0]:.3f})")
    better = yarn["digit"][2] - plain["digit"][2]
    if abs(better) < 0.02:
        parts.append("so in this run YaRN and plain RoPE extend about equally well")
    else:
        parts.append(f"so in this run YaRN is {'ahead' if better > 0 else 'behind'} by {abs(better):.0%} of symbols "
                     "at 4x (one seed: the multi-seed summary says whether that exceeds seed-to-seed noise)")
    return "; ".join(parts) + "."


def summary_plots(out_dir: Path, seeds: list[int]) -> list[Path]:
    """For `--seeds N`: passkey accuracy and filler loss against length, mean over seeds with 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from openk2.experiments.seeds import mean_ci, seed_dir

    runs = [json.loads((seed_dir(out_dir, s) / "runs.json").read_text())["results"]["arms"] for s in seeds]
    lengths = runs[0][ARMS[0]]["lengths"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "digit", "symbol accuracy after the second KEY"),
                           (axes[1], "filler_loss", "filler loss (nats/token)")):
        for arm in ARMS:
            stats = [mean_ci([r[arm][key][i] for r in runs]) for i in range(len(lengths))]
            ax.errorbar(lengths, [m for m, _ in stats], yerr=[0 if math.isnan(h) else h for _, h in stats],
                        marker="o", ms=3, capsize=3, lw=1.2, label=arm)
        ax.set(xlabel="row length (tokens)", ylabel=label, xticks=lengths)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Mean over {len(seeds)} seeds, 95% intervals; pre-trained at {lengths[0]} tokens")
    fig.tight_layout()
    path = out_dir / "seeds.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
