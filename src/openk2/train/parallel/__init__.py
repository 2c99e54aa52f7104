"""Parallel pre-training on torch.distributed (K2 report, section 2.4): pipeline x data x expert parallelism.

config.py   the `[parallel]` run-config section (dp, ep, pp, pp_virtual_stages, pp_schedule)
mesh.py     process groups from init_device_mesh, rank coordinates
zero.py     distributed MuonClip (DistributedMuonClip): ZeRO-1 state, Newton-Schulz once per matrix, QK-Clip
owners.py   which rank orthogonalises which Muon matrix (balanced by Newton-Schulz FLOPs)
dist_muon.py  Muon over one replication group: gradients to owners, updates broadcast back
sharded_adamw.py  ZeRO-1 AdamW on DTensor shards
expert.py   expert parallelism: experts split over ep ranks, all-to-all dispatch/combine
pipeline.py pipeline stages (with virtual stages) and the torch.distributed.pipelining schedule
state.py    whole-model state gathered for saving, sliced for loading
mixed.py    bf16 weights: fp32 gradient accumulation, QK-Clip factors for fp32 masters
held.py     the state bytes a rank's tensors really hold (checks `openk2 plan`)
comm_clock.py  communication wall time, for the trainer's comm_share
trainer.py  ParallelTrainer: the Trainer under torchrun

Kept light on purpose: openk2.train.config imports ParallelConfig from here.
"""

from openk2.train.parallel.config import PP_SCHEDULES, ParallelConfig

__all__ = ["PP_SCHEDULES", "ParallelConfig"]
