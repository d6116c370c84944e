"""The one place an attention backend is chosen: from `execution.attention`, the device, the
parameters' dtype and the attention dropout, when a model is built or moved
(`DecoderLM._select_kernels`)."""

from __future__ import annotations

import torch

from megabeta.kernels import finished_groups
from megabeta.model.attention.backend import AttentionBackend
from megabeta.model.attention.explicit import ExplicitAttention
from megabeta.model.attention.merged import CpuMergedAttention, CudaMergedAttention
from megabeta.model.attention import merged_op  # noqa: F401  (registers megabeta::merged_attention)
from megabeta.model.attention.sdpa import SdpaAttention
from megabeta.model.cell_kernels import require_triton, triton_runs_on
from megabeta.model.config import ConfigError

CPU_ONLY = ("cpu_flash", "cpu_fused")
FUSED = ("cpu_flash", "cpu_fused", "cuda_flash", "triton")
"""Backends without attention dropout."""


def select_attention(name: str, *, device: torch.device, dtype: torch.dtype, dropout: float,
                     head_dim: int, depth_bias: bool, self_slot: bool) -> AttentionBackend:
    """The backend `name` (or, for `auto`, the fastest exact one for this device and dropout).

    `depth_bias`/`self_slot`: whether the arm's scores carry them (the sdpa backend stores a
    key column for each). `auto` without attention dropout: on CPU `cpu_fused` where its
    kernels build, else `cpu_flash`; on CUDA `triton` where Triton is installed, else
    `cuda_flash` (float64: `sdpa`, ATen's CUDA kernels have no float64); with dropout `sdpa`.
    """
    cpu, cuda = device.type == "cpu", device.type == "cuda"
    if name == "auto":
        if dropout or not (cpu or cuda):
            name = "sdpa"
        elif cpu:
            name = "cpu_fused" if finished_groups.build() else "cpu_flash"
        elif triton_runs_on(device):
            name = "triton"
        else:
            name = "sdpa" if dtype == torch.float64 else "cuda_flash"
    if name == "explicit":
        return ExplicitAttention(head_dim)
    if name == "sdpa":
        return SdpaAttention(head_dim, depth_bias=depth_bias, self_slot=self_slot)
    if dropout and name in FUSED:
        raise ConfigError(f"execution.attention = {name!r} has no attention dropout "
                          f"(model.dropout = {dropout}): use auto or sdpa")
    if name in CPU_ONLY and not cpu:
        raise ConfigError(f"execution.attention = {name!r} runs on CPU only, this model is on "
                          f"{device}: use auto or sdpa")
    if name == "cuda_flash" and not cuda:
        raise ConfigError(f"execution.attention = 'cuda_flash' runs on CUDA only, this model is on "
                          f"{device}: use auto")
    if name == "cpu_fused" and not finished_groups.build():
        raise ConfigError("execution.attention = 'cpu_fused': the fused CPU kernels could not be "
                          "built here (the warning above says why): use cpu_flash or auto")
    if name == "triton":
        require_triton(device, "execution.attention = 'triton'")
        from megabeta.model.attention.triton_backend import TritonAttention  # imports triton

        # Calls that bring the history as pieces (decoding) take the device's merged path.
        pieces = (CudaMergedAttention(head_dim) if cuda
                  else CpuMergedAttention(head_dim, fused_kernels=False))
        return TritonAttention(head_dim, pieces)
    if name == "cuda_flash":
        return CudaMergedAttention(head_dim)
    return CpuMergedAttention(head_dim, fused_kernels=name == "cpu_fused")
