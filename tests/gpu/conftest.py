"""What every device check shares: IEEE float32 products, the device memory freed after each
check, the time budget `megabeta bench gpu` gives the checks, and the `within` assertion that
also records the worst error in the JUnit report (bench gpu's "checks" rows)."""

from __future__ import annotations

import gc
import os
import time
from typing import Callable, Iterator

import pytest
import torch

from megabeta.bench.gpu import CHECKS_DEADLINE_ENV
from support.device_checks import assert_within, worst


@pytest.fixture(autouse=True)
def _device_settings() -> Iterator[None]:
    """fp32 checks compare against float64: TF32 products would be a 1e-3 error of their own."""
    deadline = os.environ.get(CHECKS_DEADLINE_ENV)
    if deadline and time.time() > float(deadline):
        pytest.skip("skipped for time: the checks' share of bench gpu's --budget-s is spent")
    precision, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture
def within(record_property: Callable[[str, object], None]
           ) -> Callable[[dict[str, float], float], None]:
    """`within(errors, tol)`: assert every error within `tol`, recording the worst and `tol`."""
    def check(errors: dict[str, float], tol: float) -> None:
        name, value = worst(errors)
        record_property("worst", f"{name} {value:.3g}")
        record_property("tol", tol)
        assert_within(errors, tol)
    return check
