"""The one place an attention backend is chosen: from `execution.attention`, the device and
the attention dropout, when a model is built or moved
(`DecoderLM._select_kernels`). What each backend can do is declared by the backend
(`Capabilities`); this module reads it."""

from __future__ import annotations

import warnings
from typing import Protocol

import torch

from megabeta.kernels import finished_groups
from megabeta.model.attention.backend import AttentionBackend
from megabeta.model.attention.explicit import ExplicitAttention
from megabeta.model.attention.merged import CpuMergedAttention
import megabeta.model.attention.merged_op  # noqa: F401  (registers history attention's "cpu_fused")
from megabeta.model.elementwise import require_triton, triton_runs_on
from megabeta.model.config import ConfigError


def auto_attention(*, device: torch.device, dropout: float) -> str:
    """The fastest exact backend for this device and dropout: on CPU `cpu_fused` where its
    kernels build, else `cpu_flash`; on CUDA `triton`; `explicit` with attention dropout, on
    other devices, and on CUDA without Triton (with a warning: it is slow)."""
    if dropout:
        return "explicit"
    if device.type == "cpu":
        return "cpu_fused" if finished_groups.build() else "cpu_flash"
    if device.type == "cuda":
        if triton_runs_on(device):
            return "triton"
        warnings.warn("execution.attention = auto on CUDA without Triton: the explicit backend "
                      "runs (slow, the whole score matrix per block); pip install "
                      "'megabeta[gpu]'", stacklevel=2)
    return "explicit"


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
                          "use auto or explicit")
    if caps.devices is not None and device.type not in caps.devices:
        raise ConfigError(f"{setting} runs on {' or '.join(sorted(caps.devices))} only, this "
                          f"model is on {device}: use auto")
    return backend


def _explicit(head_dim: int, *, device: torch.device, setting: str) -> AttentionBackend:
    return ExplicitAttention(head_dim)


def _cpu_flash(head_dim: int, *, device: torch.device, setting: str) -> AttentionBackend:
    return CpuMergedAttention(head_dim, fused_kernels=False)


def _cpu_fused(head_dim: int, *, device: torch.device, setting: str) -> AttentionBackend:
    if not finished_groups.build():
        raise ConfigError(f"{setting}: the fused CPU kernels could not be built here (the "
                          "warning above says why): use cpu_flash or auto")
    return CpuMergedAttention(head_dim, fused_kernels=True)


def _triton(head_dim: int, *, device: torch.device, setting: str) -> AttentionBackend:
    require_triton(device, setting)
    from megabeta.model.attention.triton_backend import TritonAttention  # imports triton

    return TritonAttention(head_dim)


class BackendFactory(Protocol):
    def __call__(self, head_dim: int, *, device: torch.device,
                 setting: str) -> AttentionBackend:
        """The backend for keys of `head_dim` on `device`; a ConfigError naming `setting` when
        it cannot run there (what it needs is missing)."""


BACKENDS: dict[str, BackendFactory] = {"explicit": _explicit, "cpu_flash": _cpu_flash,
                                       "cpu_fused": _cpu_fused, "triton": _triton}
"""Every `execution.attention` value but `auto`, and how its backend is made: a new backend is
its module and one entry here (`execution.ATTENTION_BACKENDS` lists these names)."""
