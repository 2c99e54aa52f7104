"""The pre-training loop under torchrun: the single-device Trainer with a sharded model, distributed MuonClip
(ZeRO-1 state), a rank-sharded loader and rank-aware checkpoints.

Loss normalisation: every rank's loss is its token-summed cross-entropy divided by the number of target
tokens in the whole global step (all micro-batches of all data ranks), and gradients are summed, never
averaged, over ranks and micro-batches. The summed gradient is then exactly the gradient of the global
token-mean loss, whatever the number of valid targets each rank or micro-batch happens to hold, so a parallel
run matches a single-device run of the same global batch (grad_accum = 1 there: the single-device loop
averages micro-batch means, which equals the token mean only when micro-batches hold equal target counts).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from openk2.data.loader import PackedLoader
from openk2.data.unigram import unigram_baseline
from openk2.model import ForwardStats
from openk2.model.init import draw_init_seed
from openk2.train.checkpoint import CheckpointManager
from openk2.train.config import RunConfig
from openk2.train.dcp_resume import write_run_state
from openk2.train.dcp_state import model_entries, optimizer_entries
from openk2.train.parallel import comm_clock
from openk2.train.parallel.build import build_model_part
from openk2.train.parallel.fsdp import build_fsdp_model
from openk2.train.parallel.fsdp_muonclip import FSDPMuonClip, build_fsdp_optimizer, fsdp_entries
from openk2.train.parallel.mesh import ParallelMesh, init_parallel
from openk2.train.parallel.pipeline import PipelineModel, build_schedule, pipeline_forward
from openk2.train.parallel.state import local_tensors
from openk2.train.parallel.zero import DistributedMuonClip, build_optimizer
from openk2.train.setup import prepare_shards, prepare_tokenizer, resolve_device
from openk2.train.trainer import Trainer


class _NoMetrics:
    """What ranks other than 0 log to."""

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class _ThroughputMetrics:
    """Rank 0's metrics with per-device throughput added to each logged window: `tokens_per_s_per_device`
    (the window's global tokens/s over the world size) and `comm_share` (communication seconds over step
    seconds of this rank in the window; comm_clock.py says what is timed)."""

    def __init__(self, inner, trainer: ParallelTrainer) -> None:
        self.inner, self.trainer = inner, trainer

    def log(self, record: dict) -> None:
        if "tokens_per_s" in record:
            window = self.trainer.take_time_window()
            record.update(tokens_per_s_per_device=record["tokens_per_s"] / self.trainer.mesh.world_size,
                          comm_s=window["comm_s"], step_s=window["step_s"],
                          comm_share=window["comm_s"] / window["step_s"] if window["step_s"] else 0.0)
        self.inner.log(record)

    def close(self) -> None:
        self.inner.close()


class ParallelTrainer(Trainer):
    """Trainer for `parallel.pp x dp x ep` ranks launched by torchrun (one process per rank)."""

    def __init__(self, cfg: RunConfig, out_dir: str | Path | None = None, resume: bool = False) -> None:
        device = resolve_device(cfg.train.device)
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        self.mesh: ParallelMesh = init_parallel(cfg.parallel, device)
        self.is_main = self.mesh.is_main
        if cfg.train.grad_accum < cfg.parallel.pp and cfg.parallel.pp > 1:
            raise ValueError(f"train.grad_accum={cfg.train.grad_accum} micro-batches cannot fill "
                             f"{cfg.parallel.pp} pipeline ranks; use grad_accum >= parallel.pp")
        run_dir = Path(out_dir or cfg.out_dir)
        if self.is_main:  # train (or find) the tokenizer once, before the other ranks look for it
            run_dir.mkdir(parents=True, exist_ok=True)
            latest = CheckpointManager(run_dir / "checkpoints").latest() if resume else None
            self._resume_found = latest  # verified once here; the other ranks get the path, not a re-read
            prepare_shards(cfg, prepare_tokenizer(cfg, run_dir, latest))  # shards too, when configured
        self._barrier()
        super().__init__(cfg, out_dir, resume)
        # The logged tokens/s counts every data rank's tokens; MFU is per device, so the ceiling is the measured
        # per-device matmul peak times the world size (each of pp x dp x ep devices does its share).
        self.peak_flops = self.peak_flops * self.mesh.world_size
        if cfg.parallel.pp > 1:
            self.pipeline = build_schedule(
                self.model, self.mesh, (cfg.train.batch_size, cfg.data.seq_len), cfg.train.grad_accum,
                self._pipeline_loss, self.device, logits_dtype=self.autocast_dtype or torch.float32)
            self._loss_scale = 1.0

    # ------------------------------------------------------------------------------------------ building
    def _build_model(self):
        # Only this rank's share is ever allocated (build.py); rank 0's seed draw, which a single-process run
        # with the same train.seed makes too, initialises every rank's share as that run's model.
        seed = torch.tensor(draw_init_seed(), dtype=torch.int64, device=self.device)
        if dist.is_initialized():
            dist.broadcast(seed, src=0)
        if self.cfg.parallel.shard == "fsdp2":  # weights sharded over dp by fully_shard (fsdp.py)
            self.expert_names = frozenset()
            return build_fsdp_model(self.cfg.model, self.mesh, self.device, int(seed))
        model, self.expert_names = build_model_part(self.cfg.model, self.mesh, self.device, int(seed))
        return model

    def _find_resume(self) -> Path | None:
        """Rank 0's verified choice, broadcast: checksumming the whole checkpoint on every rank would read it
        world-size times."""
        choice = [str(self._resume_found) if self.is_main and self._resume_found is not None else None]
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        return Path(choice[0]) if choice[0] is not None else None

    def _build_optimizer(self) -> DistributedMuonClip | FSDPMuonClip:
        if self.cfg.parallel.shard == "fsdp2":
            return build_fsdp_optimizer(self.model, self.mesh, self.cfg.optim.muonclip_kwargs())
        return build_optimizer(self.model, self.expert_names, self.mesh, self.cfg.optim.muonclip_kwargs())

    def _build_train_loader(self) -> PackedLoader:
        # Each data rank gets (and reads) only its rows of the global micro-batch; the position is global.
        rows = self.cfg.train.batch_size * self.mesh.num_data_ranks
        return PackedLoader(self.cfg.data, self.tokenizer, rows, split="train",
                            data_rank=self.mesh.data_rank, num_data_ranks=self.mesh.num_data_ranks)

    def _unigram_baseline(self) -> float:
        return unigram_baseline(self.train_loader)

    def _open_metrics(self):
        return _ThroughputMetrics(super()._open_metrics(), self) if self.is_main else _NoMetrics()

    # ------------------------------------------------------------------------------------------ one step
    _window = None

    def _optimizer_step(self) -> dict:
        """Trainer's step, its wall time and communication time added to the current log window."""
        comm_clock.take()  # what ran between steps (evaluation, checkpoints) is not a step's
        start = time.perf_counter()
        record = super()._optimizer_step()
        window = self._window or {"comm_s": 0.0, "step_s": 0.0}
        window["step_s"] += time.perf_counter() - start
        window["comm_s"] += comm_clock.take()
        self._window = window
        return record

    def take_time_window(self) -> dict[str, float]:
        """{comm_s, step_s} summed over the steps since the last call, and reset."""
        window, self._window = self._window or {"comm_s": 0.0, "step_s": 0.0}, None
        return window

    def _forward_backward(self, stats: ForwardStats) -> tuple[float, torch.Tensor | None, int]:
        batches = [next(self.train_loader) for _ in range(self.cfg.train.grad_accum)]
        targets = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
        total = max(1.0, self._sum(float(sum(targets)), "data"))
        tokens = sum(b["input_ids"].numel() for b in batches) * self.mesh.num_data_ranks
        if isinstance(self.model, PipelineModel):
            loss, counts = self._pipeline_step(batches, total, stats)
        else:
            loss, counts = self._data_parallel_step(batches, targets, total, stats)
        return loss, counts, tokens

    def _data_parallel_step(self, batches, targets, total, stats: ForwardStats) -> tuple[float, torch.Tensor | None]:
        loss, counts, row_share = 0.0, None, self._aux_weight()
        for i, (batch, n) in enumerate(zip(batches, targets, strict=True)):
            with self._autocast():
                out = self._forward(batch, stats)
            # out.loss is the micro-batch's token mean (+ its aux loss); the token mean times n / total is this
            # micro-batch's share of the global token mean. The aux loss is a mean over sequences, so its share
            # is the micro-batch's share of the step's rows. Backward runs even without targets: the EP
            # all-to-all needs every rank.
            aux = out.aux_loss if out.aux_loss is not None else 0.0
            share = (out.loss - aux) * (n / total) if n else out.logits.sum() * 0.0
            share = share + aux * row_share
            if i == len(batches) - 1:  # the last backward: each gradient bucket goes out once it is final
                self._arm_grad_overlap(1)
            share.backward()
            loss += share.item()
            if out.tokens_per_expert is not None:
                counts = out.tokens_per_expert if counts is None else counts + out.tokens_per_expert
        if counts is not None:  # global counts: the bias update must see every rank's tokens
            counts = counts.float().to(self.device)
            with comm_clock.timed():
                dist.all_reduce(counts, group=self.mesh.group("data"))
        return self._sum(loss, "data"), counts

    def _pipeline_step(self, batches, total, stats: ForwardStats) -> tuple[float, torch.Tensor | None]:
        ids = torch.cat([b["input_ids"] for b in batches]).to(self.device)
        labels = torch.cat([b["labels"] for b in batches]).to(self.device)
        self._loss_scale = 1.0 / total
        self.model.set_aux_weight(self._aux_weight())
        losses: list[torch.Tensor] = []
        args = (ids,) if self.model.has_first_stage else ()
        kwargs = {"target": labels, "losses": losses} if self.model.has_last_stage else {}
        # The schedule runs every micro-batch's backward inside step(); a stage parameter accumulates once per
        # micro-batch, so its gradient is final at its len(batches)-th accumulation (grad_hooks.py counts them).
        self._arm_grad_overlap(len(batches))
        with self._autocast(), self.model.recording(stats):
            # return_outputs=False: torch would otherwise keep every micro-batch's logits until the step ends.
            self.pipeline.step(*args, return_outputs=False, **kwargs)
        # Only last-stage ranks hold cross-entropy losses; every rank adds its stages' weighted aux losses.
        loss = self._sum(sum(float(x.detach()) for x in losses) + self.model.recorded_aux_loss(), None)
        counts = stats.tokens_per_expert()
        if counts is not None:  # each stage fills its layers' rows; data ranks add their tokens
            counts = counts.to(self.device)
            with comm_clock.timed():
                dist.all_reduce(counts)
        return loss, counts

    def _arm_grad_overlap(self, fires: int) -> None:
        """ZeRO-1 with parallel.overlap_grad_reduce: reduce buckets from backward hooks after `fires` accumulations."""
        if isinstance(self.optimizer, DistributedMuonClip):
            self.optimizer.arm_overlap(fires)

    def _aux_weight(self) -> float:
        """One micro-batch's share of the step's rows: the weight of its (sequence-mean) aux loss."""
        return 1.0 / (self.cfg.train.grad_accum * self.mesh.num_data_ranks)

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Token-summed cross-entropy of one micro-batch over the step's global target count."""
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
        return ce * self._loss_scale

    def _clip_gradients(self) -> float:
        self.optimizer.reduce_gradients()
        return self.optimizer.clip_grad_norm(self.cfg.optim.grad_clip)

    def _should_stop(self) -> bool:
        # A signal reaches ranks at slightly different moments; they must stop after the same step.
        flag = torch.tensor(float(self._stop_requested), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss over the batches a single-device run scores, each data rank scoring its rows."""
        self.model.eval()
        rows = self.cfg.train.batch_size * self.mesh.num_data_ranks
        val = PackedLoader(self.cfg.data, self.tokenizer, rows, split="val", loop=False,
                           data_rank=self.mesh.data_rank, num_data_ranks=self.mesh.num_data_ranks)
        total, count = 0.0, 0
        for i, batch in enumerate(val):
            if i == self.cfg.train.eval_batches:
                break
            ids = batch["input_ids"].to(self.device)
            with self._autocast():
                if isinstance(self.model, PipelineModel):
                    logits = pipeline_forward(self.model, self.mesh, ids)
                else:
                    logits = self.model(ids).logits
            if logits is not None:  # None: this pipeline rank does not hold the last stage
                targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100).to(self.device)
                total += float(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                                               reduction="sum"))
            count += int((batch["labels"][:, 1:] != -100).sum())
        self.model.train()
        count = self._sum(count, "data")
        if count == 0:
            raise ValueError("the validation split is empty; raise data.val_fraction")
        return self._sum(total, None) / count  # over every rank: only last-stage ranks hold a loss

    # ------------------------------------------------------------------------------------------ checkpoints
    # Trainer.save_checkpoint / _load_checkpoint with this rank's part: every rank writes its own DCP shards
    # (expert rows and ZeRO-1 slices as blocks of the full tensors), so any layout resumes the checkpoint.
    _ckpt_group = None

    def _checkpoint_group(self):
        if self._ckpt_group is None and dist.is_initialized():  # DCP's collectives (and async writes) off the
            self._ckpt_group = dist.new_group(backend="gloo")  # training group, on CPU
        return self._ckpt_group

    def _training_state(self, fresh: bool):
        if isinstance(self.optimizer, FSDPMuonClip):  # every rank's rows, under the same layout-free names
            return fsdp_entries(self.model, self.optimizer)
        tensors = local_tensors(self.model)
        ep, rank = self.mesh.config.ep, self.mesh.ep_rank
        rows = {n: (rank * t.shape[0], ep * t.shape[0]) for n, t in tensors.items() if n in self.expert_names}
        named = (self.model.named_full_parameters() if isinstance(self.model, PipelineModel)
                 else list(self.model.named_parameters()))
        optim, install = optimizer_entries(self.optimizer, named, rows, fresh=fresh)
        return {**model_entries(tensors, rows), **optim}, install

    def _layout(self) -> dict[str, int]:
        return {"pp": self.mesh.config.pp, "dp": self.mesh.config.dp, "ep": self.mesh.config.ep}

    def _checkpointer_rank(self) -> int:
        return self.mesh.rank

    def _write_main_files(self, path: Path) -> None:
        """Rank 0: config.json, tokenizer, run state; no HF weights (`openk2 export` streams them from dcp/)."""
        hf = {**self.cfg.model.to_hf(), "torch_dtype": self.cfg.parallel.param_dtype}  # the weights' dtype
        (path / "config.json").write_text(json.dumps(hf, indent=2))
        self.tokenizer.save(path)
        write_run_state(path, {"step": self.step, "tokens_seen": self.tokens_seen, "loss_ema": self.loss_ema,
                               "loader": self.train_loader.state_dict(), "schedule": self.schedule.to_dict(),
                               "parallel": self._layout()})

    # ------------------------------------------------------------------------------------------ collectives
    def _sum(self, value: float, axis: str | None) -> float:
        """Sum a Python float over one mesh axis ("data", "pp", ...) or, with None, over every rank."""
        t = torch.tensor(value, dtype=torch.float64, device=self.device)  # NCCL reduces device tensors only
        with comm_clock.timed():
            dist.all_reduce(t, group=None if axis is None else self.mesh.group(axis))
        return float(t)

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()
