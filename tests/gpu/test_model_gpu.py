"""beta_1.2 on the GPU with `execution.attention = "triton"`, against float64 CPU references
(the explicit backend) and against itself on other schedules: c = T equals the standard arm,
prefill + steps equal the forward, logits, loss and every parameter gradient equal the explicit
backend's, the wavefront schedule equals the block schedule, the compiled and CUDA-graphed
static block step equal the eager loop (in one compiled graph; two CUDA graphs), and the
compiled wavefront the eager one (one graph per kind of wave); with document masks (spec §7) as
well."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from megabeta.model import ModelConfig
from support.device_checks import (DTYPES, FULL_SIZE, GPU_ONLY, GRAD_TOL, MODEL_CASES,
                                   MODEL_SHAPES, MODEL_TOL, decoding_errors, explicit_errors,
                                   model_shape, one_block_errors, static_step_errors,
                                   wavefront_errors)

pytestmark = GPU_ONLY

BACKEND = "triton"
CUDA = torch.device("cuda")
SHAPES = [pytest.param(shape, marks=[FULL_SIZE] if shape == "wide" else [])
          for shape in MODEL_SHAPES]


@pytest.fixture(autouse=True)
def _triton() -> None:
    pytest.importorskip("triton", reason="triton is not installed (pip install 'megabeta[gpu]')")


def _explicit(part: int, documents: bool = False) -> Callable[..., dict[str, float]]:
    """Logits and loss (0) or the parameter gradients (1) against the explicit backend, with
    a document mask (spec §7) when `documents`."""
    return lambda dtype, fields, length, prompt: explicit_errors(
        BACKEND, dtype, CUDA, fields, length, documents)[part]


CHECKS: dict[str, tuple[Callable[..., dict[str, float]], dict[str, float]]] = {
    "one_block_equals_standard": (lambda dtype, fields, length, prompt: one_block_errors(
        BACKEND, dtype, CUDA, fields, length), MODEL_TOL),
    "prefill_steps_equal_forward": (lambda dtype, fields, length, prompt: decoding_errors(
        BACKEND, dtype, CUDA, fields, length, prompt), MODEL_TOL),
    "logits_loss_equal_explicit": (_explicit(0), MODEL_TOL),
    "gradients_equal_explicit": (_explicit(1), GRAD_TOL),
    "wavefront_equals_block": (lambda dtype, fields, length, prompt: wavefront_errors(
        BACKEND, dtype, CUDA, fields, length), GRAD_TOL),
    "documents_logits_loss_equal_explicit": (_explicit(0, documents=True), MODEL_TOL),
    "documents_gradients_equal_explicit": (_explicit(1, documents=True), GRAD_TOL),
    "documents_wavefront_equals_block": (lambda dtype, fields, length, prompt: wavefront_errors(
        BACKEND, dtype, CUDA, fields, length, documents=True), GRAD_TOL),
}
"""Each check: its errors from (dtype, config fields, length, prompt), and its tolerances."""
BF16_GRADIENTS = {"gradients_equal_explicit", "wavefront_equals_block",
                  "documents_gradients_equal_explicit", "documents_wavefront_equals_block"}
"""Gradient checks that bf16 parameters may miss: every gradient sum rounds to bf16, on any
backend (0.10-0.15 of a bias gradient's scale on the CPU's; docs/benchmarks/2026-12-04-gpu.md:
0.09-0.12 on triton), and training keeps float32 parameters under autocast. They run and report,
as expected failures."""
shapes = pytest.mark.parametrize("shape", SHAPES)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@shapes
@pytest.mark.parametrize("case", MODEL_CASES)
@pytest.mark.parametrize("check", CHECKS)
def test_model_on_triton(check: str, case: str, shape: str, dtype: str, within,
                         request: pytest.FixtureRequest) -> None:
    if dtype == "bf16" and check in BF16_GRADIENTS:
        request.applymarker(pytest.mark.xfail(reason="bf16 parameters round every gradient sum "
                                                     "(BF16_GRADIENTS)"))
    measure, tol = CHECKS[check]
    fields, length, prompt = model_shape(shape, case)
    within(measure(DTYPES[dtype], fields, length, prompt), tol[dtype])


@shapes
@pytest.mark.parametrize("documents", [False, True], ids=["", "documents"])
@pytest.mark.parametrize("mode,graphs", [("compiled", 1), ("graphed", 2)])
def test_static_block_step_equals_eager(mode: str, graphs: int, documents: bool, shape: str,
                                        within) -> None:
    """fp32, MHA: compiling takes a minute, one case is enough; with a document mask too (its
    bounds an input of the same one graph, spec §7)."""
    fields, length, _ = model_shape(shape, "mha")
    errors, got = static_step_errors(BACKEND, torch.float32, CUDA, fields, length, mode,
                                     documents)
    within(errors, GRAD_TOL["fp32"])
    assert got == graphs, f"{got} graphs, expected {graphs}"


@shapes
@pytest.mark.parametrize("documents", [False, True], ids=["", "documents"])
@pytest.mark.parametrize("mode,per_kind", [("compiled", 1), ("graphed", 2)])
def test_static_wavefront_equals_eager(mode: str, per_kind: int, documents: bool, shape: str,
                                       within) -> None:
    """fp32, MHA, wave checkpointing: one compiled graph, or a forward and a backward CUDA
    graph, per kind of wave (`WavePlan.kinds`) over two steps; loss and gradients the eager
    wavefront's."""
    from megabeta.model.wavefront import WavePlan

    fields, length, _ = model_shape(shape, "mha")
    errors, got = static_step_errors(BACKEND, torch.float32, CUDA, fields, length, mode,
                                     documents, schedule="wavefront")
    within(errors, GRAD_TOL["fp32"])
    config = ModelConfig(**fields)
    layers = config.num_layers
    kinds = WavePlan(-(-length // config.block_size), layers,
                     min(config.depth_window, layers - 1) + 1).kinds()
    assert got == per_kind * kinds, f"{got} graphs, expected {per_kind} per kind of wave ({kinds})"
