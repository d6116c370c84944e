"""What rank 0 reports: stdout lines, TensorBoard scalars, and `metrics.jsonl`; MFU against the
real peak of the device in use (a table of known GPUs, or a matmul measured at start-up on CPU)."""

from __future__ import annotations

import json
import logging
import resource
import time
from pathlib import Path
from typing import Any, Callable

import torch

from megabeta.train.trackers import Tracker

log = logging.getLogger("megabeta")

# Dense peak FLOP/s per device (bf16 tensor cores, fp32 without TF32), from the vendors' sheets.
GPU_PEAKS: dict[str, tuple[float, float]] = {
    "B200": (2250e12, 80e12),
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "L4": (121e12, 30.3e12),
    "A10": (125e12, 31.2e12),
    "RTX 4090": (165e12, 82.6e12),
    "V100": (125e12, 15.7e12),
}


def measure_matmul_peak(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """Best FLOP/s of a square matmul on this process's CPU threads."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from) of one rank's device for `dtype` matmuls."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bf16, fp32) in GPU_PEAKS.items():
            if key in name:
                return (bf16 if dtype == torch.bfloat16 else fp32), f"table entry {key} ({name})"
        log.warning("no peak FLOP/s known for %s; MFU is measured against a matmul", name)
    return measure_matmul_peak(dtype), f"measured {dtype} matmul on {device.type}"


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak, or resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class MetricsLogger:
    """Rank 0 writes every logged step to stdout, metrics.jsonl and its trackers (TensorBoard
    under <run_dir>/tb, W&B: trackers.py)."""

    def __init__(self, run_dir: str | Path, *, enabled: bool,
                 trackers: Callable[[], list[Tracker]]) -> None:
        self.enabled = enabled
        self.jsonl = None
        self.trackers: list[Tracker] = []
        if not enabled:
            return
        run_dir = Path(run_dir)
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.trackers = trackers()

    def log(self, step: int, metrics: dict[str, Any], prefix: str = "train", *,
            quiet: bool = False) -> None:
        """One record; `quiet`: to metrics.jsonl and the trackers only, not stdout (many
        scalars, like the dials)."""
        if not self.enabled:
            return
        record = {"step": step, **({} if prefix == "train" else {"split": prefix}), **metrics}
        self.jsonl.write(json.dumps(record) + "\n")
        scalars = {f"{prefix}/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
        for tracker in self.trackers:
            tracker.scalars(step, scalars)
        if not quiet:
            log.info("%s step %d | %s", prefix, step,
                     " | ".join(_fmt(k, v) for k, v in metrics.items()))

    def histograms(self, step: int, values: dict[str, torch.Tensor], prefix: str) -> None:
        if not self.enabled:
            return
        for name, tensor in values.items():
            for tracker in self.trackers:
                tracker.histogram(step, f"{prefix}/{name}", tensor)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        for tracker in self.trackers:
            tracker.close()


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key} {value:.3e}"
        if key == "mfu":
            return f"mfu {100 * value:.2f}%"
        return f"{key} {value:.4g}"
    return f"{key} {value}"
