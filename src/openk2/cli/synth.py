"""`openk2 synth` (being moved here)."""

from openk2.agentic.synth_cli import synth_main as synth_main

__all__ = ["synth_main"]
