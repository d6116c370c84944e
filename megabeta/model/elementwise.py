"""The one place a model's elementwise kernels (RMSNorm, RoPE, SwiGLU) are chosen, from
`execution.elementwise_kernels` and the device, when a model is built or moved
(`DecoderLM._select_kernels`)."""

from __future__ import annotations

import importlib.util
import os

import torch

from megabeta.kernels.ops import target_device_type
from megabeta.model.config import ConfigError
from megabeta.model.layers import TORCH_KERNELS, ElementwiseKernels


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels run on `device`: triton installed, and a CUDA device (or kernels
    prepared for one: `megabeta.kernels.compile_target`) or, on CPU, Triton's interpreter
    (`TRITON_INTERPRET=1`, read when the kernels are defined)."""
    return importlib.util.find_spec("triton") is not None and (
        target_device_type(device) == "cuda"
        or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"))


def require_triton(device: torch.device, setting: str) -> None:
    """Raise ConfigError naming `setting` (e.g. "execution.attention = 'triton'") when Triton
    kernels cannot run on `device` (`triton_runs_on`), saying what to do."""
    if importlib.util.find_spec("triton") is None:
        raise ConfigError(f"{setting} needs triton, which is not installed: pip install "
                          "'megabeta[gpu]' (or choose another value)")
    if not triton_runs_on(device):
        raise ConfigError(f"{setting} runs on CUDA devices (or on CPU under Triton's interpreter, "
                          f"TRITON_INTERPRET=1 set before start-up); this model is on {device}")


def select_elementwise_kernels(name: str, *, device: torch.device) -> ElementwiseKernels:
    """The implementation `torch` (megabeta.kernels.torch_elementwise), `triton`
    (megabeta.kernels.triton_elementwise), or for `auto` triton on a CUDA device where it is
    installed, else torch."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_runs_on(device) else "torch"
    if name == "torch":
        return TORCH_KERNELS
    require_triton(device, f"execution.elementwise_kernels = {name!r}")
    return ElementwiseKernels.named(name)
