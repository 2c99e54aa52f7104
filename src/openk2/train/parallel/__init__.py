"""Parallel pre-training on torch.distributed (K2 report, section 2.4): pipeline x data x expert parallelism.

config.py   the `[parallel]` run-config section (dp, ep, pp, pp_virtual_stages, pp_schedule)
mesh.py     process groups from init_device_mesh, rank coordinates
zero.py     ZeRO-1 data parallelism with distributed Muon and QK-Clip (ZeroMuonClip)
expert.py   expert parallelism: experts split over ep ranks, all-to-all dispatch/combine
pipeline.py pipeline stages (with virtual stages) and the torch.distributed.pipelining schedule
state.py    whole-model state gathered for saving, sliced for loading
trainer.py  ParallelTrainer: the Trainer under torchrun

Kept light on purpose: openk2.train.config imports ParallelConfig from here.
"""

from openk2.train.parallel.config import PP_SCHEDULES, ParallelConfig

__all__ = ["PP_SCHEDULES", "ParallelConfig"]
