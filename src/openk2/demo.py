"""`openk2 demo`: the main job on a laptop CPU (until pre-training lands: one tiny-model training step)."""

from __future__ import annotations

import argparse
import time

import torch

from openk2.cli import format_param_table
from openk2.config import ModelConfig
from openk2.model import K2ForCausalLM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="openk2 demo")
    parser.add_argument("--preset", default="tiny", choices=ModelConfig.preset_names())
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cfg = ModelConfig.preset(args.preset)
    print(format_param_table(cfg.num_params(), title=args.preset))
    model = K2ForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len))
    start = time.perf_counter()
    out = model(ids, labels=ids)
    out.loss.backward()
    seconds = time.perf_counter() - start
    print(f"forward+backward on {ids.numel()} random tokens: loss {out.loss.item():.4f} "
          f"(ln V = {torch.log(torch.tensor(float(cfg.vocab_size))):.4f}), {ids.numel() / seconds:,.0f} tokens/s")
    return 0
