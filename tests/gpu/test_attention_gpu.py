"""The Triton block attention (megabeta/kernels/triton_attention.py) on the GPU, forward and
backward, fp32 and bf16, against the float64 reference (support/reference_attention.py): the
output and every gradient within KERNEL_TOL of the reference's scale. Inputs are
bf16-representable, so one reference serves both dtypes. Cases: interpreter sizes and
t19_flash's (d_h 200, T 4096; MHA, GQA with a deep-token window, the first block)."""

from __future__ import annotations

import pytest
import torch

from support.device_checks import (ATTENTION_CASES, DTYPES, FULL_SIZE, GPU_ONLY, KERNEL_TOL,
                                   AttentionCase, block_attention_errors)

pytestmark = GPU_ONLY

CASES = [pytest.param(case, id=case.name.replace(" ", "-"),
                      marks=[FULL_SIZE] if case.name.startswith("t19") else [])
         for case in ATTENTION_CASES]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_block_attention_matches_float64_reference(case: AttentionCase, dtype: str,
                                                   within) -> None:
    pytest.importorskip("triton", reason="triton is not installed (pip install 'megabeta[gpu]')")
    errors = block_attention_errors(case, DTYPES[dtype], torch.device("cuda"))
    within(errors, KERNEL_TOL[dtype])
