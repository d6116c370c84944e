"""megabeta.kernels.multi_tensor: many copies as one multi-tensor launch per pair of dtypes."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megabeta.kernels.multi_tensor import cloned, copy_all


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func._schema.name != "aten::empty_strided" \
                and func._schema.name != "aten::empty_like":
            self.seen[func._schema.name.removeprefix("aten::")] += 1
        return func(*args, **(kwargs or {}))


def test_copies_are_one_launch_per_pair_of_dtypes() -> None:
    """A run's copies in and out (embeddings, weights, documents; outputs and gradients) are
    one multi-tensor copy per pair of dtypes, not one launch per tensor, and keep layouts."""
    src = [torch.randn(3, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64),
           torch.randn(2, 2, dtype=torch.float64).t(), torch.tensor(7)]
    dst = [torch.empty_like(t) for t in src]
    with _Ops() as ops:
        copy_all(dst, src)
        copies = cloned(src)
    assert dict(ops.seen) == {"_foreach_copy_": 4}
    for out in (dst, copies):
        assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(out, src))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(copies, src))


def test_mixed_dtypes_copy_across() -> None:
    src = [torch.randn(4, dtype=torch.float32), torch.randn(4, dtype=torch.float64)]
    dst = [torch.empty(4, dtype=torch.bfloat16), torch.empty(4, dtype=torch.float64)]
    copy_all(dst, src)
    assert torch.equal(dst[0], src[0].to(torch.bfloat16)) and torch.equal(dst[1], src[1])
