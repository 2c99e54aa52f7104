"""MuonClip: Muon + AdamW + per-head QK-Clip, and the WSD learning-rate schedule."""

from openk2.optim.muon import Muon, zeropower_via_newtonschulz5
from openk2.optim.muonclip import ClipStats, MuonClip
from openk2.optim.param_groups import build_optimizers, default_muon_filter, param_groups
from openk2.optim.qk_clip import QKClip, reduce_max_logits
from openk2.optim.schedule import WSDConfig, WSDScheduler, tokens_to_steps, wsd_lr

__all__ = [
    "ClipStats", "Muon", "MuonClip", "QKClip", "WSDConfig", "WSDScheduler", "build_optimizers",
    "default_muon_filter", "param_groups", "reduce_max_logits", "tokens_to_steps", "wsd_lr",
    "zeropower_via_newtonschulz5",
]
