"""Inference-side helpers: K2's chat template and tool-call parsers."""
