"""`openk2 pretrain` (being moved here)."""

from openk2.train.pretrain import main as pretrain_main

__all__ = ["pretrain_main"]
