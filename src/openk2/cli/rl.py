"""`openk2 rl` (being moved here)."""

from openk2.rl.trainer import rl_main as rl_main

__all__ = ["rl_main"]
