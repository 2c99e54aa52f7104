"""`openk2 sft` (being moved here)."""

from openk2.train.sft import sft_main as sft_main

__all__ = ["sft_main"]
