"""Where one training step of our model spends its CPU time: torch.profiler self time by op and by module, the
forward and the backward apart (used by `bench_model.py --profile K`).

Forward ops are charged to the innermost module of interest they ran in (forward hooks open a profiler range
per call); backward ops to the autograd node that ran them (`GroupedMmBackward0`, `RMSNormFunctionBackward`,
...). The reported step is the fastest (least disturbed) of `steps` profiled ones.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, record_function

MODULE_KINDS = ("RMSNorm", "MLAttention", "Router", "RoutedExperts", "MoE", "MLP", "Embedding")
NODE_PREFIX = "autograd::engine::evaluate_function: "


def _tag_modules(model: torch.nn.Module) -> list:
    """Forward hooks opening a profiler range `module:<Kind>` around every call of a module of interest."""
    handles, open_ranges = [], []

    def enter(module, _args):
        rf = record_function(f"module:{type(module).__name__}")
        rf.__enter__()
        open_ranges.append(rf)

    def leave(_module, _args, _out):
        open_ranges.pop().__exit__(None, None, None)

    for m in model.modules():
        if type(m).__name__ in MODULE_KINDS:
            handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    return handles


def _where(event) -> tuple[str, str]:
    """(phase, owner) of an op: its outermost range ('forward'/'backward') and the innermost module range or
    autograd node above it ('model' for forward ops outside every tagged module: lm_head, loss, rope)."""
    owner, e = None, event
    while e.cpu_parent is not None:
        e = e.cpu_parent
        if owner is None and e.name.startswith("module:"):
            owner = e.name[len("module:"):]
        elif owner is None and e.name.startswith(NODE_PREFIX):
            owner = e.name[len(NODE_PREFIX):]
    return e.name, owner or "model"


def profile_step(model: torch.nn.Module, ids: torch.Tensor, top: int, steps: int = 3) -> None:
    """Print our step's top ops and owners (modules in forward, autograd nodes in backward) by self CPU time."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with record_function("forward"):
            loss = model(ids, labels=ids).loss
        with record_function("backward"):
            loss.backward()

    handles = _tag_modules(model)
    try:
        step()
        best = None
        for _ in range(steps):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            ops: dict[tuple[str, str], list[float]] = {}
            owners: dict[tuple[str, str], float] = {}
            for e in prof.events():
                if e.name in ("forward", "backward") or e.name.startswith("module:"):
                    continue
                phase, owner = _where(e)
                cell = ops.setdefault((phase, e.name), [0.0, 0])
                cell[0] += e.self_cpu_time_total
                cell[1] += 1
                owners[(phase, owner)] = owners.get((phase, owner), 0.0) + e.self_cpu_time_total
            total = sum(t for t, _ in ops.values())
            if best is None or total < best[0]:
                best = (total, ops, owners)
    finally:
        for h in handles:
            h.remove()
    total, ops, owners = best
    print(f"\nour training step by self CPU time ({next(model.parameters()).dtype}, "
          f"fastest of {steps} profiled steps: {total / 1e6:.2f} s):")
    for phase in ("forward", "backward"):
        spent = sum(t for (p, _), (t, _) in ops.items() if p == phase)
        print(f"  {phase}: {spent / 1e3:.1f} ms ({100 * spent / total:.1f}% of the step)")
        print("    by owner:")
        mine = sorted(((o, t) for (p, o), t in owners.items() if p == phase), key=lambda r: -r[1])
        for owner, t in mine[:top]:
            print(f"      {owner:<56} {t / 1e3:8.1f} ms {100 * t / total:5.1f}%")
        print("    by op:")
        rows = sorted(((k[1], *v) for k, v in ops.items() if k[0] == phase), key=lambda r: -r[1])
        for name, t, n in rows[:top]:
            print(f"      {name:<56} {t / 1e3:8.1f} ms {100 * t / total:5.1f}%  calls {n}")
