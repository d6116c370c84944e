"""What rank 0 reports: stdout lines, TensorBoard scalars, and `metrics.jsonl`; MFU against the
real peak of the device in use (a table of known GPUs, or a matmul measured at start-up on CPU)."""

from __future__ import annotations

import json
import logging
import resource
import time
from pathlib import Path
from typing import Any

import torch

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
    """Rank 0 writes every logged step to stdout, TensorBoard (<run_dir>/tb) and metrics.jsonl."""

    def __init__(self, run_dir: str | Path, *, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.jsonl = None
        self.tb = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))

    def log(self, step: int, metrics: dict[str, Any], prefix: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": step, **({} if prefix == "train" else {"split": prefix}), **metrics}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{prefix}/{key}", value, step)
            self.tb.flush()
        log.info("%s step %d | %s", prefix, step, " | ".join(_fmt(k, v) for k, v in metrics.items()))

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key} {value:.3e}"
        if key == "mfu":
            return f"mfu {100 * value:.2f}%"
        return f"{key} {value:.4g}"
    return f"{key} {value}"
