"""The conformance benchmark's request set, tools, scorer and server launcher (see bench_conformance.py)."""
