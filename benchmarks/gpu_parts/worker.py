"""The worker process of the GPU check: runs parts one after another, each under an alarm, and sends one record
per part through a pipe (synchronously: a crash right after a send loses nothing). A part that times out or
breaks the CUDA context ends the worker (the parent starts a fresh one for the parts after it); a part that
merely raises is recorded and the next one runs in the same process.

Messages: ("start", name, limit_s), ("done", name, record), ("fatal", reason) when no part can run at all.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import time
import traceback
from pathlib import Path

from .registry import BY_NAME

CUDA_BROKEN = ("CUDA error", "device-side assert", "illegal memory access", "AcceleratorError", "CUBLAS_STATUS")
MIN_LIMIT_S = 5.0  # a part is skipped rather than started with less time than this (or than its own limit)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


def _inject(mode: str) -> None:
    """A planted failure (--inject-failure) to show the other parts still run."""
    if mode == "raise":
        raise RuntimeError("injected failure (--inject-failure)")
    if mode == "crash":
        os._exit(70)
    if mode == "hang":  # deaf to the alarm: only the parent's kill ends it
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    raise ValueError(f"unknown --inject-failure mode {mode!r}")


def _on_alarm(signum, frame) -> None:
    from .context import PartTimeout

    raise PartTimeout("part ran past its time limit")


def run_part(name: str, settings: dict, limit: float) -> dict:
    """Run one part under an alarm of `limit` seconds; the record always has a status and a one-line reason."""
    import torch

    from .context import PartContext, PartSkipped, PartTimeout

    part = BY_NAME[name]
    module_name, func_name = part.target.split(":")
    device = torch.device(settings["device"])
    ctx = PartContext(device, settings["quick"], time.monotonic() + limit, Path(settings["repo"]))
    started = time.monotonic()
    record: dict = {"name": name, "title": part.title, "limit_s": round(limit, 1)}
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        if name in settings["inject"]:
            _inject(settings["inject"][name])
        func = getattr(importlib.import_module(f"gpu_parts.{module_name}"), func_name)
        result = func(ctx)
        record.update(status=result.get("status", "measured"), reason=result.get("reason", ""),
                      metrics=result.get("metrics", {}), tables=result.get("tables", {}))
    except PartSkipped as err:
        record.update(status="skipped", reason=str(err))
    except PartTimeout:
        record.update(status="timeout", reason=f"ran past its {limit:.0f} s limit", restart=True)
    except AssertionError as err:
        record.update(status="failed", reason=_one_line(err), traceback=traceback.format_exc(limit=-4))
    except BaseException as err:  # noqa: BLE001 -- any error of a part is its result, never the run's end
        restart = any(marker in f"{type(err).__name__} {err}" for marker in CUDA_BROKEN)
        record.update(status="error", reason=_one_line(err), traceback=traceback.format_exc(limit=-4),
                      restart=restart)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    record["seconds"] = round(time.monotonic() - started, 2)
    record["notes"] = ctx.notes
    gc.collect()
    if device.type == "cuda" and not record.get("restart"):
        torch.cuda.empty_cache()
    return record


def work(conn, names: list[str], settings: dict) -> None:
    """The worker's entry point (a spawned process): run `names` in order until done or a part asks to restart."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no registry on a GPU machine: fail fast, never wait on a network
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    if settings["device"] == "cuda" and not torch.cuda.is_available():
        conn.send(("fatal", f"CUDA is not available to torch {torch.__version__} "
                            f"(built with CUDA {torch.version.cuda or 'none'})"))
        return
    if settings["device"] == "cpu" and settings.get("threads"):
        torch.set_num_threads(settings["threads"])
    for name in names:
        left = settings["deadline"] - time.time()
        limit = min(settings["limits"][name], left)
        if limit < min(MIN_LIMIT_S, settings["limits"][name]):
            conn.send(("done", name, {"name": name, "title": BY_NAME[name].title, "status": "skipped",
                                      "reason": f"out of time: {max(left, 0):.0f} s of the run's budget left",
                                      "seconds": 0.0}))
            continue
        conn.send(("start", name, limit))
        record = run_part(name, settings, limit)
        conn.send(("done", name, record))
        if record.get("restart"):
            return
