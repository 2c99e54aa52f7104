"""`openk2 export --checkpoint DIR --out DIR [--dtype float32|bfloat16|float16]`: HF safetensors from DCP shards."""

from __future__ import annotations

import argparse
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def export_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="openk2 export",
        description="Write a training checkpoint's model as HF-layout safetensors (transformers, `local:`, "
                    "`openk2 serve` load the result), streamed from its DCP shards one tensor at a time")
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint directory (step-N) or a run directory (its newest complete checkpoint)")
    parser.add_argument("--out", required=True, help="directory to write model*.safetensors, config.json, tokenizer")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the written weights")
    args = parser.parse_args(argv)

    import torch

    from openk2.train.checkpoint import CheckpointManager, verify_checkpoint
    from openk2.train.hf_export import export_hf

    source = Path(args.checkpoint)
    if (source / "checkpoints").is_dir():
        found = CheckpointManager(source / "checkpoints").latest()
        if found is None:
            raise ValueError(f"{source} holds no complete checkpoint")
        source = found
    elif not source.is_dir():
        raise ValueError(f"--checkpoint {source} does not exist")
    elif (problem := verify_checkpoint(source)) is not None:
        raise ValueError(f"checkpoint {source} is incomplete or corrupt: {problem}")
    files = export_hf(source, args.out, dtype=getattr(torch, args.dtype))
    print(f"exported {source} -> {args.out} ({len(files)} safetensors file{'s' * (len(files) != 1)})")
    return 0
