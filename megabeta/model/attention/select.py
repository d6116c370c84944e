"""The one place an attention backend is chosen: from `execution.attention`, the device and the
attention dropout, when a model is built or moved (`DecoderLM._select_attention`)."""

from __future__ import annotations

import torch

from megabeta.kernels import finished_groups
from megabeta.model.attention.backend import AttentionBackend
from megabeta.model.attention.cpu_merged import CpuMergedAttention
from megabeta.model.attention.explicit import ExplicitAttention
from megabeta.model.attention.sdpa import SdpaAttention
from megabeta.model.config import ConfigError


def select_attention(name: str, *, device: torch.device, dropout: float, head_dim: int,
                     depth_bias: bool, self_slot: bool) -> AttentionBackend:
    """The backend `name` (or, for `auto`, the fastest exact one for this device and dropout).

    `depth_bias`/`self_slot`: whether the arm's scores carry them (the sdpa backend stores a
    key column for each). `auto`: on CPU without attention dropout `cpu_fused` where the
    kernels build, else `cpu_flash`; anywhere else `sdpa`.
    """
    cpu = device.type == "cpu"
    if name == "auto":
        if not cpu or dropout:
            name = "sdpa"
        else:
            name = "cpu_fused" if finished_groups.build() else "cpu_flash"
    if name == "explicit":
        return ExplicitAttention(head_dim)
    if name == "sdpa":
        return SdpaAttention(head_dim, depth_bias=depth_bias, self_slot=self_slot)
    if not cpu:
        raise ConfigError(f"execution.attention = {name!r} runs on CPU only, this model is on "
                          f"{device}: use auto or sdpa")
    if dropout:
        raise ConfigError(f"execution.attention = {name!r} has no attention dropout "
                          f"(model.dropout = {dropout}): use auto or sdpa")
    if name == "cpu_fused" and not finished_groups.build():
        raise ConfigError("execution.attention = 'cpu_fused': the fused CPU kernels could not be "
                          "built here (the warning above says why): use cpu_flash or auto")
    return CpuMergedAttention(head_dim, fused_kernels=name == "cpu_fused")
