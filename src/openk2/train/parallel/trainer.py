"""The pre-training loop under torchrun: the single-device Trainer with a sharded model, ZeRO-1 MuonClip,
a sharded loader and rank-aware checkpoints.

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
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from openk2.data.loader import PackedLoader
from openk2.data.unigram import unigram_baseline
from openk2.model import ForwardStats, K2ForCausalLM
from openk2.rng import capture_rng_state, restore_rng_state
from openk2.train.checkpoint import CheckpointManager
from openk2.train.config import RunConfig
from openk2.train.parallel.expert import shard_experts
from openk2.train.parallel.mesh import ParallelMesh, init_parallel
from openk2.train.parallel.pipeline import PipelineModel, build_schedule, pipeline_forward
from openk2.train.parallel.state import gather_full_state, load_full_state, save_full_model
from openk2.train.parallel.zero import ZeroMuonClip
from openk2.train.setup import prepare_tokenizer, resolve_device
from openk2.train.trainer import STATE_FILE, Trainer

OPTIMIZER_SHARDS = "optimizer"  # checkpoint subdirectory: one rank-NNNNN.pt per rank (ZeRO-1 slices + RNG)


class ShardedLoader:
    """This data rank's rows of each global batch; every rank walks the same global stream, so the loader
    position is one state for all ranks and a run can resume deterministically."""

    def __init__(self, loader: PackedLoader, data_rank: int, num_data_ranks: int) -> None:
        self.loader, self.data_rank, self.num_data_ranks = loader, data_rank, num_data_ranks

    def __iter__(self) -> ShardedLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self.loader)
        rows = batch["input_ids"].shape[0] // self.num_data_ranks
        return {k: v[self.data_rank * rows:(self.data_rank + 1) * rows] for k, v in batch.items()}

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


class _NoMetrics:
    """What ranks other than 0 log to."""

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


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
            prepare_tokenizer(cfg, run_dir, latest)
        self._barrier()
        super().__init__(cfg, out_dir, resume)
        if cfg.parallel.pp > 1:
            self.pipeline = build_schedule(
                self.model, self.mesh, (cfg.train.batch_size, cfg.data.seq_len), cfg.train.grad_accum,
                self._pipeline_loss, self.device, logits_dtype=self.autocast_dtype or torch.float32)
            self._loss_scale = 1.0

    # ------------------------------------------------------------------------------------------ building
    def _build_model(self):
        model = K2ForCausalLM(self.cfg.model)  # the same seed on every rank: identical replicas
        self.expert_names = shard_experts(model, self.mesh)
        return PipelineModel(model, self.mesh) if self.mesh.config.pp > 1 else model

    def _build_optimizer(self) -> ZeroMuonClip:
        if isinstance(self.model, PipelineModel):
            named, attention = self.model.named_full_parameters(), self.model.attention
        else:
            named, attention = list(self.model.named_parameters()), dict(enumerate(self.model.attention_layers()))
        return ZeroMuonClip(self.model, named, attention, **self.cfg.optim.muonclip_kwargs(),
                            expert_names=self.expert_names, dense_group=self.mesh.group("data"),
                            expert_group=self.mesh.group("dp"))

    def _build_train_loader(self) -> ShardedLoader:
        rows = self.cfg.train.batch_size * self.mesh.num_data_ranks  # the global micro-batch
        loader = PackedLoader(self.cfg.data, self.tokenizer, rows, split="train")
        return ShardedLoader(loader, self.mesh.data_rank, self.mesh.num_data_ranks)

    def _unigram_baseline(self) -> float:
        return unigram_baseline(self.train_loader.loader)

    def _open_metrics(self):
        return super()._open_metrics() if self.is_main else _NoMetrics()

    # ------------------------------------------------------------------------------------------ one step
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
        loss, counts = 0.0, None
        for batch, n in zip(batches, targets, strict=True):
            with self._autocast():
                out = self._forward(batch, stats)
            # out.loss is the micro-batch's token mean; times n / total it is this micro-batch's share of the
            # global token mean. Backward runs even without targets: the EP all-to-all needs every rank.
            share = out.loss * (n / total) if n else out.logits.sum() * 0.0
            share.backward()
            loss += share.item()
            if out.tokens_per_expert is not None:
                counts = out.tokens_per_expert if counts is None else counts + out.tokens_per_expert
        if counts is not None:  # global counts: the bias update must see every rank's tokens
            counts = counts.float().to(self.device)
            dist.all_reduce(counts, group=self.mesh.group("data"))
        return self._sum(loss, "data"), counts

    def _pipeline_step(self, batches, total, stats: ForwardStats) -> tuple[float, torch.Tensor | None]:
        ids = torch.cat([b["input_ids"] for b in batches]).to(self.device)
        labels = torch.cat([b["labels"] for b in batches]).to(self.device)
        self._loss_scale = 1.0 / total
        losses: list[torch.Tensor] = []
        args = (ids,) if self.model.has_first_stage else ()
        kwargs = {"target": labels, "losses": losses} if self.model.has_last_stage else {}
        with self._autocast(), self.model.recording(stats):
            self.pipeline.step(*args, **kwargs)
        loss = self._sum(sum(float(x.detach()) for x in losses), None)  # only last-stage ranks hold losses
        counts = stats.tokens_per_expert()
        if counts is not None:  # each stage fills its layers' rows; data ranks add their tokens
            counts = counts.to(self.device)
            dist.all_reduce(counts)
        return loss, counts

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
        val = PackedLoader(self.cfg.data, self.tokenizer, rows, split="val", loop=False)
        total, count = 0.0, 0
        for i, batch in enumerate(ShardedLoader(val, self.mesh.data_rank, self.mesh.num_data_ranks)):
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
    def save_checkpoint(self) -> Path:
        """Rank 0 writes the gathered model (HF layout) and run state; every rank adds its optimizer slice."""
        full = gather_full_state(self.model, self.mesh)
        staging = self.ckpts.root / f".shards-{self.step:07d}"
        staging.mkdir(parents=True, exist_ok=True)
        shard = staging / f"rank-{self.mesh.rank:05d}.pt"
        torch.save({"optimizer": self.optimizer.state_dict(), "rng": capture_rng_state()}, shard.with_suffix(".tmp"))
        shard.with_suffix(".tmp").replace(shard)
        self._barrier()
        if self.is_main:
            def write(path: Path) -> None:
                save_full_model(full, self.cfg.model, path)
                self.tokenizer.save(path)
                shards = path / OPTIMIZER_SHARDS
                shards.mkdir()
                for rank in range(self.mesh.world_size):  # only this layout's ranks, never a stale file
                    (staging / f"rank-{rank:05d}.pt").replace(shards / f"rank-{rank:05d}.pt")
                shutil.rmtree(staging, ignore_errors=True)
                state = {"step": self.step, "tokens_seen": self.tokens_seen, "loss_ema": self.loss_ema,
                         "loader": self.train_loader.state_dict(), "schedule": self.schedule.to_dict(),
                         "parallel": {"pp": self.mesh.config.pp, "dp": self.mesh.config.dp,
                                      "ep": self.mesh.config.ep}}
                (path / STATE_FILE).write_text(json.dumps(state))

            self.ckpts.save(self.step, write)
        self._barrier()
        return self.ckpts.path_for(self.step)

    def _load_checkpoint(self, path: Path) -> None:
        shard_file = path / OPTIMIZER_SHARDS / f"rank-{self.mesh.rank:05d}.pt"
        if not shard_file.is_file():
            raise ValueError(f"{path} has no optimizer shard for rank {self.mesh.rank}; resume with the parallel "
                             "layout the checkpoint was saved with")
        loaded = K2ForCausalLM.from_pretrained(path, dtype=torch.float32)
        load_full_state(self.model, loaded.state_dict(), self.mesh)
        shard = torch.load(shard_file, map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(shard["optimizer"])
        state = json.loads((path / STATE_FILE).read_text())
        self.step, self.tokens_seen, self.loss_ema = state["step"], state["tokens_seen"], state["loss_ema"]
        self.train_loader.load_state_dict(state["loader"])
        restore_rng_state(shard["rng"])
        if self.is_main:
            print(f"resumed from {path} at step {self.step}", file=sys.stderr)

    # ------------------------------------------------------------------------------------------ collectives
    def _sum(self, value: float, axis: str | None) -> float:
        """Sum a Python float over one mesh axis ("data", "pp", ...) or, with None, over every rank."""
        t = torch.tensor(value, dtype=torch.float64, device=self.device)  # NCCL reduces device tensors only
        dist.all_reduce(t, group=None if axis is None else self.mesh.group(axis))
        return float(t)

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()
