"""The fused Triton elementwise kernels (megabeta/kernels/triton_elementwise.py) on the GPU,
forward and backward, fp32 and bf16, against the torch implementation of
megabeta.kernels.elementwise run in float64: every output and gradient within KERNEL_TOL of the
reference's scale, at small and t19_flash sizes."""

from __future__ import annotations

import pytest
import torch

from support.device_checks import (ELEMENTWISE_KERNELS, CELL_SHAPES, DTYPES, FULL_SIZE, GPU_ONLY,
                                   KERNEL_TOL, cell_kernel_errors)

pytestmark = GPU_ONLY

SIZES = [pytest.param(size, marks=[FULL_SIZE] if size == "t19" else []) for size in CELL_SHAPES]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kernel", ELEMENTWISE_KERNELS)
def test_cell_kernel_matches_float64_layers(kernel: str, size: str, dtype: str, within) -> None:
    pytest.importorskip("triton", reason="triton is not installed (pip install 'megabeta[gpu]')")
    errors = cell_kernel_errors(kernel, size, DTYPES[dtype], torch.device("cuda"))
    within(errors, KERNEL_TOL[dtype])
