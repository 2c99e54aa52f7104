"""`openk2 params`: parameter counts (total, activated, per component) of a preset or an HF config.json."""

from __future__ import annotations

import argparse
import json

from openk2.config import ModelConfig, ParamCount


def params_main(argv: list[str] | None = None) -> int:
    """Print the parameter table (or JSON) of a preset or HF config."""
    parser = argparse.ArgumentParser(prog="openk2 params", description="Parameter counts of a model preset")
    parser.add_argument("--preset", default="kimi-k2", choices=ModelConfig.preset_names())
    parser.add_argument("--config", help="an HF config.json (file or checkpoint directory) instead of a preset")
    parser.add_argument("--json", action="store_true", help="print JSON with keys total, activated, breakdown")
    args = parser.parse_args(argv)
    cfg = ModelConfig.from_hf(args.config) if args.config else ModelConfig.preset(args.preset)
    count = cfg.num_params()
    if args.json:
        print(json.dumps(count.as_dict(), indent=2))
        return 0
    print(format_param_table(count, title=args.config or args.preset))
    return 0


def format_param_table(count: ParamCount, title: str) -> str:
    """A human-readable table of a ParamCount."""
    rows = [f"{title}: parameters", f"{'component':<16}{'count':>20}{'share':>9}"]
    for name, n in count.breakdown.items():
        rows.append(f"{name:<16}{n:>20,}{n / count.total:>9.2%}")
    rows.append(f"{'total':<16}{count.total:>20,}")
    rows.append(f"{'activated':<16}{count.activated:>20,}{count.activated / count.total:>9.2%}")
    return "\n".join(rows)
