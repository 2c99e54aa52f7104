"""The machine part: versions, the device, its datasheet bf16 peak and the bf16 matmul ceiling measured here."""

from __future__ import annotations

import importlib.metadata
import platform

import torch
from common import machine_summary

from openk2.train.flops import measure_matmul_peak

from .context import PartContext
from .sizes import datasheet_peak


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run(ctx: PartContext) -> dict:
    """Record what the run ran on; measure the matmul ceiling MFU is also stated against."""
    metrics = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none",
        "transformers": _version("transformers"),
        "machine": machine_summary(),
        "device": str(ctx.device),
    }
    size = 256 if ctx.quick else 8192
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        peak, source = datasheet_peak(props.name)
        metrics.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                       memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                       cudnn=torch.backends.cudnn.version(), datasheet_bf16_peak_tflops=peak and peak / 1e12,
                       datasheet_source=source)
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    ceiling = measure_matmul_peak(dtype, device=str(ctx.device), size=size, repeats=10)
    metrics[f"matmul_ceiling_{str(dtype).removeprefix('torch.')}_tflops"] = ceiling / 1e12
    metrics["matmul_ceiling_shape"] = f"{size}x{size} @ ({size}x{size})^T, median of 10 after 1 warm-up"
    return {"status": "measured", "metrics": metrics}
