"""The pre-training loop: MuonClip + WSD on the packed corpus, with accumulation, mixed precision,
aux-loss-free bias updates, validation, bad-step handling, metrics, and resumable checkpoints."""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from openk2.data.loader import PackedLoader
from openk2.data.unigram import unigram_baseline
from openk2.model import ForwardStats, K2ForCausalLM
from openk2.model.compile import compile_blocks, compile_seconds
from openk2.optim.muonclip import ClipWindow, MuonClip, max_logits_due
from openk2.rng import capture_rng_state, restore_rng_state, seed_everything
from openk2.train.checkpoint import CheckpointManager
from openk2.train.config import RunConfig
from openk2.train.dcp_checkpoint import ShardedCheckpointer
from openk2.train.dcp_resume import (
    fmt_layout,
    load_rank_state,
    load_training_state,
    read_run_state,
    write_run_state,
)
from openk2.train.dcp_state import model_entries, optimizer_entries
from openk2.train.flops import measure_matmul_peak, training_flops_per_token
from openk2.train.memory import apply_memory_options
from openk2.train.metrics import MetricsLogger, plot_run
from openk2.train.setup import prepare_tokenizer, resolve_device, resolve_precision
from openk2.train.stages import StagePlan, apply_model_config


class BadStepError(RuntimeError):
    """Raised when a NaN/inf or spiking loss stops the run (train.on_bad_step = "stop")."""


@dataclass
class RunSummary:
    out_dir: Path
    step: int
    checkpoint: Path | None
    val_loss: float | None
    unigram_val_loss: float
    tokens_per_s: float
    plots: list[Path]


class Trainer:
    """Owns the model, optimizer, loaders and run directory of one pre-training run."""

    def __init__(self, cfg: RunConfig, out_dir: str | Path | None = None, resume: bool = False) -> None:
        # `run_cfg` is the config as written; `cfg` is the current stage's view of it (openk2.train.stages).
        self.run_cfg = cfg
        self.plan = StagePlan(cfg)
        self.out_dir = Path(out_dir or cfg.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tc = cfg.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        self.device = resolve_device(tc.device)
        self.autocast_dtype = resolve_precision(tc.precision, self.device)
        self.ckpts = CheckpointManager(self.out_dir / "checkpoints", keep_last=tc.keep_checkpoints)
        resume_from = self._find_resume() if resume else None
        if resume and resume_from is None:
            print(f"note: no complete checkpoint in {self.ckpts.root}; starting from scratch", file=sys.stderr)
        self.stage = self.plan.stages[self._saved_stage(resume_from) if resume_from is not None else 0]
        self.cfg = self.stage.cfg

        seed_everything(tc.seed)
        self.tokenizer = prepare_tokenizer(cfg, self.out_dir, resume_from)
        self.model = self._build_model().to(self.device)
        self.memory = apply_memory_options(self.model, cfg.memory)  # [memory]: recompute, FP8 saves, offload
        if tc.compile:  # after the memory wrappers, as torchtitan orders AC and compile
            compile_blocks(self.model)
        self.model.loss_chunk_tokens = tc.loss_chunk_tokens  # 0: the plain loss over whole logits
        self.optimizer = self._build_optimizer()
        self._set_tau(self.stage.tau)
        self.schedule = self.plan.build_schedule()
        self.train_loader = self._build_train_loader()
        self.step = 0
        self.tokens_seen = 0
        self.clip_window = ClipWindow()  # QK-Clip activity since the last logged record
        self.loss_ema: float | None = None
        if resume_from is not None:
            self._load_checkpoint(resume_from)
        self.unigram = self._unigram_baseline()
        self.flops_per_token = training_flops_per_token(self.cfg.model, self.cfg.data.seq_len)
        self.peak_flops = measure_matmul_peak(self.autocast_dtype or torch.float32, self.device)
        self._stop_requested = False
        self._mid_step = False
        (self.out_dir / "run_config.json").write_text(json.dumps(cfg.to_dict(), indent=2, default=str))
        if self.plan.explicit and self.is_main:
            print(self.stage.describe(len(self.plan.stages)), file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------------------------ loop
    def run(self, max_steps: int | None = None) -> RunSummary:
        """Train until `train.steps` (or `max_steps`), checkpointing on the way and whenever the run stops."""
        tc = self.cfg.train
        stop_at = min(tc.steps, max_steps) if max_steps else tc.steps
        self.metrics = self._open_metrics()
        previous = {s: signal.signal(s, self._request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        window_loss, window_tokens, window_start = [], 0, time.perf_counter()
        tokens_per_s, val_loss, last_ckpt = 0.0, None, None
        last_note = time.perf_counter() - self.PROGRESS_EVERY_S
        bar = tqdm(total=stop_at, initial=self.step, desc=self.progress_label, unit="step", dynamic_ncols=True,
                   disable=None if self.is_main else True)
        try:
            while self.step < stop_at and not self._should_stop():
                self._sync_stage()
                record = self._train_step()
                bar.update(1)
                if record.get("skipped"):
                    self.metrics.log(record)
                    continue
                window_loss.append(record["loss"])
                window_tokens += record["tokens"]
                if self.step % tc.log_every == 0 or self.step == stop_at:
                    elapsed = time.perf_counter() - window_start
                    tokens_per_s = window_tokens / elapsed
                    record.update(loss=float(np.mean(window_loss)), tokens_per_s=tokens_per_s,
                                  mfu=tokens_per_s * self.flops_per_token / self.peak_flops)
                    if tc.compile:  # seconds spent compiling so far (the first window's tok/s includes them)
                        record["compile_s"] = compile_seconds()
                    window_loss, window_tokens, window_start = [], 0, time.perf_counter()
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}",
                                    max_logit=f"{record.get('max_logit', float('nan')):.1f}")
                    record.update(self.clip_window.pop())
                    if self.step % tc.eval_every == 0 or self.step == stop_at:
                        val_loss = self.evaluate()
                        record.update(val_loss=val_loss, unigram_val_loss=self.unigram)
                    self.metrics.log(record)
                    if bar.disable and self.is_main:  # no terminal (a log file, a pipe): flushed lines instead
                        last_note = self._note_progress(record, stop_at, last_note)
                if self.step % tc.checkpoint_every == 0:
                    last_ckpt = self.save_checkpoint()
            if self.step == tc.steps and self.stage.index != self.plan.index_at(self.step):
                self._enter_stage(self.plan.index_at(self.step), model_only=True)  # trailing 0-step stages
                last_ckpt = self.save_checkpoint()
        finally:
            bar.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._mid_step:  # a second Ctrl-C or an error inside a step: the state may be half-updated
                print("warning: stopped inside a step; keeping the last complete checkpoint", file=sys.stderr)
            elif last_ckpt is None or last_ckpt.name != self.ckpts.path_for(self.step).name:
                last_ckpt = self.save_checkpoint() if self.step > 0 else last_ckpt
            self.finish_checkpoints()  # an asynchronous save commits here at the latest
            self.metrics.close()
        if self._stop_requested:
            print(f"stopped at step {self.step} on request; checkpoint {last_ckpt}", file=sys.stderr)
        plots = plot_run(self.out_dir) if self.is_main else []
        return RunSummary(self.out_dir, self.step, last_ckpt, val_loss, self.unigram, tokens_per_s, plots)

    PROGRESS_EVERY_S = 30.0  # without a terminal: a progress line at least this far apart (and at validations)

    def _note_progress(self, record: dict, stop_at: int, last: float) -> float:
        """Print one flushed progress line when validation ran, the run ends, or PROGRESS_EVERY_S has passed."""
        now = time.perf_counter()
        if "val_loss" not in record and self.step != stop_at and now - last < self.PROGRESS_EVERY_S:
            return last
        stage = f" [{self.stage.name}]" if self.plan.explicit else ""
        val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
        print(f"{self.progress_label}{stage} step {self.step}/{stop_at} loss {record['loss']:.4f}{val} "
              f"tok/s {record['tokens_per_s']:,.0f}", file=sys.stderr, flush=True)
        return now

    def _train_step(self) -> dict:
        self._mid_step = True
        try:
            record = self._optimizer_step()
        except BadStepError:
            self._mid_step = False  # raised after the update was dropped: the state is whole, so checkpoint it
            raise
        self._mid_step = False
        return record

    def _optimizer_step(self) -> dict:
        tc = self.cfg.train
        lr = self.plan.lr_at(self.step, self.schedule)
        self.optimizer.set_lr(lr)
        self.model.train()
        # This step's record; MuonClip reads it. The probe runs every step with QK-Clip on, else at the cadence.
        probe = max_logits_due(self.step + 1, self.optimizer.tau, self.cfg.optim.max_logit_every)
        stats = ForwardStats(self.model.config, track_max_logits=probe)
        loss, counts, tokens = self._forward_backward(stats)
        self.step += 1
        problem = self._bad_loss(loss)
        grad_norm = self._clip_gradients() if problem is None else float("nan")
        if problem is None and not math.isfinite(grad_norm):
            problem = f"non-finite gradient norm ({grad_norm})"
        if problem is not None:
            self.optimizer.skip_step()
            message = f"step {self.step}: {problem}; update skipped"
            if tc.on_bad_step == "stop":
                raise BadStepError(message.replace("update skipped", "stopping (train.on_bad_step = stop)"))
            print(f"warning: {message}", file=sys.stderr)
            return {"step": self.step, **self._stage_tag(), "skipped": problem, "loss": loss, "lr": lr}
        clip = self.optimizer.step(stats.max_logits())
        self.clip_window.add(self.step, clip)
        self.optimizer.zero_grad()
        if counts is not None:
            self.model.update_router_biases(counts, self.cfg.optim.bias_update_rate)
        self.loss_ema = loss if self.loss_ema is None else 0.95 * self.loss_ema + 0.05 * loss
        self.tokens_seen += tokens
        load = (counts / counts.sum(dim=1, keepdim=True)).tolist() if counts is not None else []
        return {"step": self.step, **self._stage_tag(), "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "tokens": tokens, "tokens_seen": self.tokens_seen, **clip.as_dict(),
                "qk_clip_tau": self.optimizer.tau or float("nan"), "expert_load": load,
                "expert_imbalance": [max(row) * len(row) for row in load]}

    def _forward_backward(self, stats: ForwardStats) -> tuple[float, torch.Tensor | None, int]:
        """Accumulate one step's gradients (recording into `stats`); returns the mean loss, tokens per expert
        [MoE layers, E], tokens."""
        accum = self.cfg.train.grad_accum
        losses, counts, tokens = [], None, 0
        for _ in range(accum):
            batch = next(self.train_loader)
            with self._autocast():
                out = self._forward(batch, stats)
            (out.loss / accum).backward()
            losses.append(out.loss.item())
            counts = out.tokens_per_expert if counts is None else counts + out.tokens_per_expert
            tokens += batch["input_ids"].numel()
        return float(np.mean(losses)), counts, tokens

    def _bad_loss(self, loss: float) -> str | None:
        if not math.isfinite(loss):
            return f"non-finite loss ({loss})"
        warmed_up = self.step > self.cfg.schedule.warmup_steps and self.loss_ema is not None
        if warmed_up and loss > self.cfg.train.spike_factor * self.loss_ema:
            return f"loss spike ({loss:.3f} > {self.cfg.train.spike_factor} x running mean {self.loss_ema:.3f})"
        return None

    def _clip_gradients(self) -> float:
        max_norm = self.cfg.optim.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    # Hooks a fine-tuning run overrides (openk2.train.sft): the initial model, the data and the forward call.
    def _find_resume(self) -> Path | None:
        """The newest checkpoint that verifies (a full checksum pass over its files)."""
        return self.ckpts.latest()

    def _build_model(self) -> K2ForCausalLM:
        return K2ForCausalLM(self.cfg.model)

    # Hooks a parallel run overrides (openk2.train.parallel): optimizer, metrics, stopping together.
    is_main = True  # this process logs, plots and writes the model
    progress_label = "pretrain"  # the progress bar's name

    def _build_optimizer(self) -> MuonClip:
        return MuonClip(self.model, **self.cfg.optim.muonclip_kwargs())

    def _open_metrics(self) -> MetricsLogger:
        # Records past the current step belong to a run that died after its last checkpoint: dropped.
        return MetricsLogger(self.out_dir, resume_step=self.step if self.step else None,
                             tensorboard=self.cfg.train.tensorboard)

    def _should_stop(self) -> bool:
        return self._stop_requested

    def _build_train_loader(self) -> PackedLoader:
        return PackedLoader(self.cfg.data, self.tokenizer, self.cfg.train.batch_size, split="train")

    def _unigram_baseline(self) -> float:
        return unigram_baseline(self.train_loader)

    def _forward(self, batch: dict[str, torch.Tensor], stats: ForwardStats | None = None):
        return self.model(batch["input_ids"].to(self.device), labels=batch["labels"].to(self.device), stats=stats)

    def _val_loader(self) -> PackedLoader:
        return PackedLoader(self.cfg.data, self.tokenizer, self.cfg.train.batch_size, split="val", loop=False)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over the first `train.eval_batches` validation batches (the same each time)."""
        self.model.eval()
        total, count = 0.0, 0
        for i, batch in enumerate(self._val_loader()):
            if i == self.cfg.train.eval_batches:
                break
            with self._autocast():
                out = self._forward(batch)
            n = int((batch["labels"][:, 1:] != -100).sum())
            total, count = total + out.loss.item() * n, count + n
        self.model.train()
        if count == 0:
            raise ValueError("the validation split is empty; raise data.val_fraction")
        return total / count

    def _request_stop(self, signum, frame) -> None:
        if self._stop_requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        print(f"\nsignal {signum}: finishing step {self.step + 1}, then writing a checkpoint", file=sys.stderr)
        self._stop_requested = True

    # ------------------------------------------------------------------------------------------ stages
    def _sync_stage(self) -> None:
        """Enter the stage that runs the next step if it is not the current one."""
        index = self.plan.index_at(self.step)
        if index != self.stage.index:
            self._enter_stage(index)

    def _enter_stage(self, index: int, model_only: bool = False) -> None:
        """Switch to stage `index`: the model's RoPE and length, QK-Clip's tau and, unless `model_only`, the train
        loader (seq_len, batch, mixture), which continues the previous stream when the corpus is the same."""
        self.stage = self.plan.stages[index]
        self.cfg = self.stage.cfg
        apply_model_config(self.model, self.cfg.model)
        self._set_tau(self.stage.tau)
        self.flops_per_token = training_flops_per_token(self.cfg.model, self.cfg.data.seq_len)
        if not model_only:
            previous = self.train_loader.state_dict()
            self.train_loader = self._build_train_loader()
            try:
                self.train_loader.load_state_dict(previous)
            except ValueError as err:  # another mixture: this stage's stream starts at its beginning
                print(f"note: stage {self.stage.name!r} starts a new data stream ({err})", file=sys.stderr)
        if self.is_main:
            print(self.stage.describe(len(self.plan.stages)), file=sys.stderr, flush=True)

    def _set_tau(self, tau: float | None) -> None:
        self.optimizer.tau = tau
        if getattr(self.optimizer, "qk_clip", None) is not None and tau is not None:
            self.optimizer.qk_clip.tau = tau

    def _stage_tag(self) -> dict:
        return {"stage": self.stage.name} if self.plan.explicit else {}

    def _saved_stage(self, path: Path) -> int:
        """The stage a checkpoint was written in (its run state; older checkpoints: the stage of its last step)."""
        state = read_run_state(path)
        saved = state.get("stage")
        if saved is None:
            return self.plan.index_at(max(state["step"] - 1, 0))
        names = [s.name for s in self.plan.stages]
        if saved["name"] not in names:
            raise ValueError(f"checkpoint {path} was written in stage {saved['name']!r}, which this config does not "
                             f"have (stages: {', '.join(names)})")
        return names.index(saved["name"])

    # ------------------------------------------------------------------------------------------ checkpoints
    # Model and optimizer go to DCP shards under layout-free names (openk2.train.dcp_state), so any layout
    # resumes them; run state, tokenizer and, for one process, the HF-layout model go beside them.
    _checkpointer: ShardedCheckpointer | None = None

    def save_checkpoint(self) -> Path:
        """Write model + optimizer (DCP), loader and schedule position, RNG states; async if train.async_checkpoint."""
        if self._checkpointer is None:
            self._checkpointer = ShardedCheckpointer(self.ckpts, self._checkpoint_group(),
                                                     async_save=self.cfg.train.async_checkpoint)
        entries, _ = self._training_state(fresh=False)
        return self._checkpointer.save(self.step, entries, {"rng": capture_rng_state()}, self._write_main_files)

    def finish_checkpoints(self) -> Path | None:
        """Commit a checkpoint still being written in the background; its path, or None when none was."""
        return None if self._checkpointer is None else self._checkpointer.finish()

    def _checkpoint_group(self):
        return None  # one process: no collectives

    def _training_state(self, fresh: bool):
        """(DCP entries of model + optimizer, install); fresh=True gives buffers to load into."""
        optim, install = optimizer_entries(self.optimizer, list(self.model.named_parameters()), fresh=fresh)
        return {**model_entries(self.model.state_dict(keep_vars=True)), **optim}, install

    def _layout(self) -> dict[str, int]:
        return {"pp": 1, "dp": 1, "ep": 1}

    def _write_main_files(self, path: Path) -> None:
        self.model.save_pretrained(path)  # the HF export: transformers and `local:` load the directory as is
        self.tokenizer.save(path)
        write_run_state(path, {"step": self.step, "tokens_seen": self.tokens_seen, "loss_ema": self.loss_ema,
                               "loader": self.train_loader.state_dict(), "schedule": self.schedule.to_dict(),
                               "parallel": self._layout(),
                               "stage": {"index": self.stage.index, "name": self.stage.name}})

    def _load_checkpoint(self, path: Path) -> None:
        state = read_run_state(path)
        entries, install = self._training_state(fresh=True)
        load_training_state(path, entries, self._checkpoint_group())
        install()
        self.step, self.tokens_seen, self.loss_ema = state["step"], state["tokens_seen"], state["loss_ema"]
        self.train_loader.load_state_dict(state["loader"])
        restore_rng_state(load_rank_state(path, self._checkpointer_rank())["rng"])
        if self.is_main:
            saved = state.get("parallel", self._layout())
            moved = "" if saved == self._layout() else f" (saved at {fmt_layout(saved)}, resharded)"
            print(f"resumed from {path} at step {self.step}{moved}", file=sys.stderr)

    def _checkpointer_rank(self) -> int:
        return 0
