"""`openk2 pipeline` (being moved here)."""

from openk2.pipeline.cli import pipeline_main as pipeline_main

__all__ = ["pipeline_main"]
