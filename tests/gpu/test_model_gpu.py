"""beta_1.2 on the GPU with `execution.attention = "triton"`, against float64 CPU references
(the explicit backend) and against itself on other schedules: c = T equals the standard arm,
prefill + steps equal the forward, logits, loss and every parameter gradient equal the explicit
backend's, the wavefront schedule equals the block schedule, and the compiled and CUDA-graphed
static block step equal the eager loop (in one compiled graph; two CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from support.device_checks import (DTYPES, FULL_SIZE, GPU_ONLY, GRAD_TOL, MODEL_CASES,
                                   MODEL_SHAPES, MODEL_TOL, decoding_errors, explicit_errors,
                                   model_shape, one_block_errors, static_step_errors,
                                   wavefront_errors)

pytestmark = GPU_ONLY

BACKEND = "triton"
CUDA = torch.device("cuda")
SHAPES = [pytest.param(shape, marks=[FULL_SIZE] if shape == "wide" else [])
          for shape in MODEL_SHAPES]

dtypes = pytest.mark.parametrize("dtype", ["fp32", "bf16"])
shapes = pytest.mark.parametrize("shape", SHAPES)
cases = pytest.mark.parametrize("case", MODEL_CASES)


@pytest.fixture(autouse=True)
def _triton() -> None:
    pytest.importorskip("triton", reason="triton is not installed (pip install 'megabeta[gpu]')")


@dtypes
@shapes
@cases
def test_one_block_equals_the_standard_arm(case: str, shape: str, dtype: str, within) -> None:
    fields, length, _ = model_shape(shape, case)
    within(one_block_errors(BACKEND, DTYPES[dtype], CUDA, fields, length), MODEL_TOL[dtype])


@dtypes
@shapes
@cases
def test_prefill_and_steps_equal_the_forward(case: str, shape: str, dtype: str, within) -> None:
    fields, length, prompt = model_shape(shape, case)
    within(decoding_errors(BACKEND, DTYPES[dtype], CUDA, fields, length, prompt),
           MODEL_TOL[dtype])


@dtypes
@shapes
@cases
def test_logits_and_loss_equal_the_explicit_backend(case: str, shape: str, dtype: str,
                                                    within) -> None:
    fields, length, _ = model_shape(shape, case)
    errors, _ = explicit_errors(BACKEND, DTYPES[dtype], CUDA, fields, length)
    within(errors, MODEL_TOL[dtype])


@dtypes
@shapes
@cases
def test_gradients_equal_the_explicit_backend(case: str, shape: str, dtype: str,
                                              within) -> None:
    fields, length, _ = model_shape(shape, case)
    _, grads = explicit_errors(BACKEND, DTYPES[dtype], CUDA, fields, length)
    within(grads, GRAD_TOL[dtype])


@dtypes
@shapes
@cases
def test_wavefront_equals_the_block_schedule(case: str, shape: str, dtype: str, within) -> None:
    fields, length, _ = model_shape(shape, case)
    within(wavefront_errors(BACKEND, DTYPES[dtype], CUDA, fields, length), GRAD_TOL[dtype])


@shapes
@pytest.mark.parametrize("mode,graphs", [("compiled", 1), ("graphed", 2)])
def test_static_block_step_equals_eager(mode: str, graphs: int, shape: str, within) -> None:
    """fp32, MHA: compiling takes a minute, one case is enough."""
    fields, length, _ = model_shape(shape, "mha")
    errors, got = static_step_errors(BACKEND, torch.float32, CUDA, fields, length, mode)
    within(errors, GRAD_TOL["fp32"])
    assert got == graphs, f"{got} graphs, expected {graphs}"
