"""The one place an attention backend is chosen: from `execution.attention`, the device and
the attention dropout, when a model is built or moved (`DecoderLM._select_kernels`). What each
backend can do is declared by the backend (`Capabilities`); this module reads it."""

from __future__ import annotations

import warnings
from typing import Protocol

import torch

from megabeta.kernels import cpu_attention
from megabeta.model.attention.backend import AttentionBackend
from megabeta.model.attention.reference import ReferenceAttention
from megabeta.model.config import ConfigError
from megabeta.model.elementwise import require_triton, triton_runs_on


def auto_attention(*, device: torch.device, dropout: float) -> str:
    """The fastest exact backend for this device and dropout: on CPU `cpu` where its kernels
    build; on CUDA `triton`; `reference` with attention dropout, on other devices, and where
    neither runs (with a warning on CUDA: it is slow)."""
    if dropout:
        return "reference"
    if device.type == "cpu" and cpu_attention.build():
        return "cpu"
    if device.type == "cuda":
        if triton_runs_on(device):
            return "triton"
        warnings.warn("execution.attention = auto on CUDA without Triton: the reference backend "
                      "runs (slow, the whole score matrix per block); pip install "
                      "'megabeta[gpu]'", stacklevel=2)
    return "reference"


def select_attention(name: str, *, device: torch.device, dropout: float,
                     head_dim: int) -> AttentionBackend:
    """The backend `name` (`auto`: `auto_attention`), checked against what it declares it
    can do; a `ConfigError` naming the setting and the way out otherwise."""
    if name == "auto":
        name = auto_attention(device=device, dropout=dropout)
    setting = f"execution.attention = {name!r}"
    backend = BACKENDS[name](head_dim, device=device, setting=setting)
    caps = backend.capabilities
    if dropout and not caps.dropout:
        raise ConfigError(f"{setting} has no attention dropout (model.dropout = {dropout}): "
                          "use auto or reference")
    if caps.devices is not None and device.type not in caps.devices:
        raise ConfigError(f"{setting} runs on {' or '.join(sorted(caps.devices))} only, this "
                          f"model is on {device}: use auto")
    return backend


def _reference(head_dim: int, *, device: torch.device, setting: str) -> AttentionBackend:
    return ReferenceAttention(head_dim)


def _cpu(head_dim: int, *, device: torch.device, setting: str) -> AttentionBackend:
    if not cpu_attention.build():
        raise ConfigError(f"{setting}: the fused CPU kernels could not be built here (the "
                          "warning above says why): use reference or auto")
    from megabeta.model.attention.cpu import CpuAttention

    return CpuAttention(head_dim)


def _triton(head_dim: int, *, device: torch.device, setting: str) -> AttentionBackend:
    require_triton(device, setting)
    from megabeta.model.attention.triton_backend import TritonAttention  # imports triton

    return TritonAttention(head_dim)


class BackendFactory(Protocol):
    def __call__(self, head_dim: int, *, device: torch.device,
                 setting: str) -> AttentionBackend:
        """The backend for keys of `head_dim` on `device`; a ConfigError naming `setting` when
        it cannot run there (what it needs is missing)."""


BACKENDS: dict[str, BackendFactory] = {"reference": _reference, "cpu": _cpu, "triton": _triton}
"""Every `execution.attention` value but `auto`, and how its backend is made: a new backend is
its module and one entry here (`execution.ATTENTION_BACKENDS` lists these names)."""
