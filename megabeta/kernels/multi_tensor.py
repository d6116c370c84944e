"""Copies of many tensors at once: one multi-tensor launch per pair of dtypes
(`torch._foreach_copy_`), where a copy each would be a launch each on a GPU. Used by a graphed
pass (model/graphs.py) to copy its inputs in and its outputs out around each replay."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def copy_all(dst: Sequence[Tensor], src: Sequence[Tensor]) -> None:
    """`d.copy_(s)` for each pair, one multi-tensor launch per pair of dtypes
    (`torch._foreach_copy_`): on a GPU each copy alone would be a launch."""
    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
    for d, s in zip(dst, src, strict=True):
        to, of = groups.setdefault((d.dtype, s.dtype), ([], []))
        to.append(d)
        of.append(s)
    for to, of in groups.values():
        torch._foreach_copy_(to, of)


def cloned(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Copies of `tensors` in their layouts (`copy_all`: one launch per dtype)."""
    out = [torch.empty_like(t) for t in tensors]
    copy_all(out, tensors)
    return out
