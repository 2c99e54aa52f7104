"""The report's claims re-measured at small scale: `openk2 experiment NAME [--quick|--full]`.

Each experiment is a module here with `run(out_dir: Path, mode: str, seed: int) -> Path` that writes
`report.md` (+ PNGs) into `out_dir` and returns the report's path; `DESCRIPTION` is its one-line summary.
"""

from __future__ import annotations

# name -> module (imported only when the experiment runs, so listing stays fast)
EXPERIMENTS: dict[str, str] = {
    "muon-vs-adamw": "openk2.experiments.muon_vs_adamw",
    "qk-clip": "openk2.experiments.qk_clip",
    "sparsity": "openk2.experiments.sparsity",
    "heads": "openk2.experiments.heads",
    "rephrase-vs-repeat": "openk2.experiments.rephrase_vs_repeat",
    "long-context": "openk2.experiments.long_context",
}
