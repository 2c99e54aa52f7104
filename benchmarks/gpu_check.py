"""One prepared GPU check: openk2's CUDA paths exercised and its headline benchmarks measured in a single short run.

Parts (benchmarks/gpu_parts/registry.py, in this order): the machine and a bf16 matmul ceiling; six correctness
checks (logits vs HF DeepseekV3 in fp32 and bf16, Muon vs torch.optim.Muon, the QK-Clip invariant, FP8
activation round-trip, CPU-offload exactness, engine cached decode vs full forward); `pytest -m cuda tests/cuda`;
train step tok/s and MFU vs HF at a K2-shaped config with the SDPA kernels used; Muon step time vs
torch.optim.Muon; the max-logit probe's overhead at 4k and 16k tokens; decode tok/s vs HF generate. docs/gpu.md
says what each measures.

Each part runs under its own time limit and the whole run under --budget (8 minutes by default, for one
H200-class GPU); parts run in a worker process, so a part that fails, hangs or crashes is reported with a one-line
reason and the rest still run (a timeout, crash or CUDA error gets a fresh worker for the parts after it). This
process never imports torch. After every part it rewrites gpu_check.json and gpu_check.md in --out.

Usage (repository root): PYTHONPATH=src python3 benchmarks/gpu_check.py --out runs/gpu-check
                         PYTHONPATH=src python benchmarks/gpu_check.py --device cpu --quick --out /tmp/gpu-dry
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shlex
import sys
import time
from pathlib import Path

from gpu_parts import report
from gpu_parts.registry import BY_NAME, PARTS

REPO = Path(__file__).resolve().parents[1]
GRACE_S = 3.0  # after a part's limit, the worker's own alarm gets this long (+10%) before the worker is killed
MODES = ("raise", "crash", "hang")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", "--tiny", action="store_true", help="dry-run sizes (seconds on a CPU), for CI")
    parser.add_argument("--budget", type=float, default=460.0,
                        help="seconds for the whole run (default 460: with the last part's grace, under 8 minutes)")
    parser.add_argument("--parts", default="", help=f"comma-separated subset of: {','.join(BY_NAME)}")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads in the worker (0: torch's)")
    parser.add_argument("--time-limit", action="append", default=[], metavar="PART=SECONDS",
                        help="override one part's time limit")
    parser.add_argument("--inject-failure", action="append", default=[], metavar=f"PART[:{'|'.join(MODES)}]",
                        help="plant a failure in a part (to check that the others still run)")
    args = parser.parse_args(argv)

    def names(text: str) -> list[str]:
        chosen = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in chosen if n not in BY_NAME]
        if unknown:
            parser.error(f"unknown part(s) {unknown}; choose from {list(BY_NAME)}")
        return chosen

    skip = set(names(args.skip))
    args.names = [n for n in (names(args.parts) or list(BY_NAME)) if n not in skip]
    args.limits = {p.name: p.limit(args.quick) for p in PARTS}
    for item in args.time_limit:
        name, _, seconds = item.partition("=")
        names(name)
        try:
            args.limits[name] = float(seconds)
        except ValueError:
            parser.error(f"--time-limit wants PART=SECONDS, got {item!r}")
    args.inject = {}
    for item in args.inject_failure:
        name, _, mode = item.partition(":")
        names(name)
        if (mode or "raise") not in MODES:
            parser.error(f"--inject-failure mode must be one of {MODES}, got {mode!r}")
        args.inject[name] = mode or "raise"
    if args.budget <= 0:
        parser.error("--budget must be positive")
    return args


class _Silent(Exception):
    """Nothing arrived from the worker in the polling interval."""


def _start(ctx, names: list[str], settings: dict):
    from gpu_parts.worker import work

    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=work, args=(send, names, settings), daemon=True)
    proc.start()
    send.close()  # the worker holds the only write end: its death ends the pipe

    def get(timeout: float):
        if not receive.poll(timeout):
            raise _Silent
        try:
            return receive.recv()
        except (EOFError, OSError) as err:  # the worker is gone; let the caller see it dead
            time.sleep(timeout)
            raise _Silent from err

    return proc, get


def _stop(proc) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join(timeout=10)


def run(args: argparse.Namespace) -> dict:
    """Run the parts in worker processes; returns the run record (also written to --out after every part)."""
    started = time.time()
    deadline = started + args.budget
    record = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)), "device": args.device,
              "quick": args.quick, "budget_s": args.budget, "wall_s": 0.0, "parts": [],
              "command": shlex.join(["python", *sys.argv]) if sys.argv else "gpu_check"}
    settings = {"device": args.device, "quick": args.quick, "deadline": deadline, "limits": args.limits,
                "inject": args.inject, "repo": str(REPO), "threads": args.threads}
    ctx = mp.get_context("spawn")
    todo = list(args.names)

    def finish(name: str, result: dict) -> None:
        todo.remove(name)
        record["parts"].append(result)
        record["wall_s"] = time.time() - started
        report.write(args.out, record)
        print(f"[gpu-check] {name}: {result['status']} in {result.get('seconds', 0):.1f} s"
              + (f" -- {result['reason']}" if result.get("reason") else ""), flush=True)

    while todo:
        proc, get = _start(ctx, list(todo), settings)
        current, kill_at = None, None
        while todo:
            try:
                message = get(0.2)
            except _Silent:
                now = time.time()
                if now > deadline + GRACE_S + 10:  # a worker stuck outside any part (start-up, say)
                    _stop(proc)
                    for name in list(todo):
                        finish(name, {"name": name, "title": BY_NAME[name].title, "status": "timeout",
                                      "reason": "the run's budget ran out with the worker unresponsive",
                                      "seconds": 0.0})
                    break
                if current and kill_at and now > kill_at:
                    _stop(proc)
                    limit = current[2]
                    finish(current[0], {"name": current[0], "title": BY_NAME[current[0]].title, "status": "timeout",
                                        "reason": f"killed: no result {now - current[1]:.0f} s after start "
                                        f"(limit {limit:.0f} s)", "seconds": round(now - current[1], 2)})
                    break
                if not proc.is_alive():
                    try:  # a message sent just before the end is still in the pipe
                        message = get(0.5)
                    except _Silent:
                        name = current[0] if current else todo[0]
                        since = current[1] if current else now
                        finish(name, {"name": name, "title": BY_NAME[name].title, "status": "error",
                                      "reason": f"worker process died (exit code {proc.exitcode})",
                                      "seconds": round(now - since, 2)})
                        break
                else:
                    continue
            kind = message[0]
            if kind == "fatal":
                for name in list(todo):
                    finish(name, {"name": name, "title": BY_NAME[name].title, "status": "skipped",
                                  "reason": message[1], "seconds": 0.0})
                break
            if kind == "start":
                print(f"[gpu-check] {message[1]}: {BY_NAME[message[1]].title} (limit {message[2]:.0f} s)", flush=True)
                current = (message[1], time.time(), message[2])
                kill_at = min(current[1] + message[2] * 1.1, deadline) + GRACE_S
            elif kind == "done":
                current, kill_at = None, None
                finish(message[1], message[2])
                if message[2].get("restart"):
                    break
        _stop(proc)
    record["wall_s"] = time.time() - started
    report.write(args.out, record)
    return record


def main(argv: list[str] | None = None) -> int:
    """Run the check; exit status 1 if any part failed, errored or timed out, 2 if every part was skipped
    (no CUDA, say), else 0."""
    args = _parse(argv)
    print(f"[gpu-check] {len(args.names)} parts on {args.device}{' (--quick)' if args.quick else ''}, "
          f"budget {args.budget:.0f} s, results in {args.out}", flush=True)
    result = run(args)
    bad = [p["name"] for p in result["parts"] if p["status"] in report.FAILING]
    print(f"[gpu-check] done in {result['wall_s']:.0f} s: "
          + ", ".join(f"{p['name']} {p['status']}" for p in result["parts"]), flush=True)
    print(f"[gpu-check] wrote {args.out / report.JSON_NAME} and {args.out / report.MD_NAME}", flush=True)
    if bad:
        return 1
    return 2 if all(p["status"] == "skipped" for p in result["parts"]) else 0


if __name__ == "__main__":
    sys.exit(main())
