"""The pass's one equivalence matrix (spec §4.3, §4.6, §5, §7): every attention backend, schedule
and executor, with documents and without, on the CPU and (rows marked `gpu`) on a CUDA GPU,
against the naive reference (tests/reference_beta12.py, float64, gradients by autograd through
it): logits, loss and every parameter's gradient.

- `test_every_flag_matches_the_reference`: the spec's flag combinations (block sizes, depth
  windows and strides, deep-token windows, qk_norm, GQA/MQA, each extra on and off) on each
  backend, the block schedule with recomputation;
- `test_the_matrix`: one case that exercises everything at once (waves of two cells, GQA, a
  deep-token window, a ragged last block) on every schedule x executor x backend x device, with
  and without documents. The CPU rows run the Triton kernels under Triton's interpreter (float32),
  the CUDA GPU rows on the device (`pytest -m gpu`).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from megabeta.model.graphs import CudaCapture, EagerCapture
from reference_beta12 import reference_logits
from support.model_helpers import ATTENTION, graphed, tiny_model, tokens

T = 19  # not a multiple of 3 or 8: the last block is ragged

CASES = {
    "c1_k2": dict(block_size=1),
    "c3_k0": dict(block_size=3, depth_window=0),
    "c3_k1": dict(block_size=3, depth_window=1),
    "c3_k2": dict(block_size=3, depth_window=2),
    "c3_kL": dict(block_size=3, depth_window=3),
    "c8_k2": dict(block_size=8),
    "cT": dict(block_size=T),
    "c_over_T": dict(block_size=32),
    "stride2": dict(block_size=3, depth_window=3, num_layers=4, depth_stride=2),
    "deep_token_window": dict(block_size=3, depth_window=2, deep_token_window=4),
    "window_within_block": dict(block_size=8, deep_token_window=2),
    "qk_norm": dict(block_size=4, qk_norm=True),
    "gqa": dict(block_size=4, num_kv_heads=2),
    "mqa_untied": dict(block_size=5, num_kv_heads=1, tie_embedding=False),
    "no_extras": dict(block_size=3, depth_bias=False, layer_enc=False, self_slot=False),
    "only_self": dict(block_size=3, depth_bias=False, layer_enc=False),
    "only_depth": dict(block_size=3, self_slot=False),
}
"""Every flag on and off, against the reference (spec §4.3)."""

MATRIX_CASE = dict(block_size=3, num_layers=4, depth_window=1, num_kv_heads=2,
                   deep_token_window=4)
"""L = 4, k = 1: the wavefront's waves hold two cells (period 2)."""

DOCUMENT_IDS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 7, [0] * 11 + [1] * 8])
"""Two samples' document ids (spec §7): boundaries inside blocks and on one."""

BACKENDS = [*ATTENTION, "triton"]
EXECUTORS = {"eager": dict(), "recompute": dict(recompute=True),
             "compiled": dict(recompute=True, compile=True),
             "graphed": dict(recompute=True, graphs=True)}
SCHEDULES = {"block": "block", "wavefront": "wave"}
CAPABLE = {"compiled": {"cpu", "triton"}, "graphed": {"triton"}}
"""Which backends an executor takes (`Capabilities.traced`, `.captured`): the others are
refused, tests/unit/model/test_executor.py."""


@functools.lru_cache(maxsize=None)
def expected(case: str, documents: bool, length: int = T
             ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The reference's logits, loss and gradients for `case` (the tiny model's float64 weights,
    `length` tokens of seeds 1 and 2, `DOCUMENT_IDS` when `documents`)."""
    overrides = MATRIX_CASE if case == "matrix" else CASES[case]
    model = tiny_model(attention="reference", **overrides)
    state = {k: v.detach().clone().requires_grad_() for k, v in model.state_dict().items()}
    x, y = tokens(length=length), tokens(length=length, seed=2)
    ids = DOCUMENT_IDS[:, :length] if documents else None
    logits = reference_logits(state, model.config, x, ids, differentiable=True)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    grads = {name: t.grad for name, t in state.items() if t.grad is not None}
    return logits.detach(), loss.detach(), grads


def check_step(model: torch.nn.Module, case: str, documents: bool, tol: dict[str, float],
               device: torch.device, length: int = T, steps: int = 2) -> None:
    """`steps` training steps of `model` (the second replays what the first captured or
    compiled): loss and every gradient against the reference's, and the logits of an
    evaluation pass."""
    logits, loss, grads = expected(case, documents, length)
    x, y = tokens(length=length).to(device), tokens(length=length, seed=2).to(device)
    kwargs = {"documents": DOCUMENT_IDS[:, :length].to(device)} if documents else {}
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        got = model(x, y, **kwargs)
        got.backward()
        torch.testing.assert_close(got.double().cpu(), loss, **tol)
        for name, p in model.named_parameters():
            want = grads.get(name)
            g = torch.zeros_like(p) if p.grad is None else p.grad
            if want is None:
                assert not g.any(), name
            else:
                torch.testing.assert_close(g.double().cpu(), want, **tol, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(model(x, **kwargs).double().cpu(), logits, **tol)


def build(backend: str, case: str, schedule: str, executor: str,
          device: torch.device) -> torch.nn.Module:
    settings = EXECUTORS[executor]
    overrides = MATRIX_CASE if case == "matrix" else CASES[case]
    triton = backend == "triton"
    model = tiny_model(attention=backend, schedule=schedule,
                       activation_checkpoint=SCHEDULES[schedule] if settings.get("recompute")
                       else "none",
                       elementwise_kernels="triton" if triton else "auto",
                       compile=settings.get("compile", False), **overrides)
    if triton or device.type == "cuda":
        model = model.float()
    model = model.to(device)
    if settings.get("graphs"):
        graphed(model, CudaCapture() if device.type == "cuda" else EagerCapture())
    return model


def tolerance(backend: str, device: torch.device) -> dict[str, float]:
    if backend == "triton" or device.type == "cuda":
        return dict(rtol=2e-4, atol=2e-5)  # float32 against float64
    return dict(rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("backend", ATTENTION)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_flag_matches_the_reference(case: str, backend: str) -> None:
    torch._dynamo.reset()
    model = build(backend, case, "block", "recompute", torch.device("cpu"))
    assert model.attention_backend.name == backend
    check_step(model, case, False, tolerance(backend, torch.device("cpu")), torch.device("cpu"))


INTERPRETED = {("eager", "block", True), ("recompute", "wavefront", False),
               ("compiled", "block", True), ("graphed", "wavefront", True),
               ("graphed", "block", False)}
"""The Triton rows run on a CPU (under Triton's interpreter, about 0.2 s a launch) on a shorter
sequence (`INTERPRETED_LENGTH`): every executor and schedule once, with documents or not; the
GPU runs the whole product."""
INTERPRETED_LENGTH = 10
"""Four blocks of c = 3, the last ragged: waves of two cells, a document boundary inside a
block."""


def _rows(device: str) -> list:
    rows = []
    for backend in (["reference", "triton"] if device == "cuda" else BACKENDS):
        for executor in EXECUTORS:
            if backend not in CAPABLE.get(executor, {backend}):
                continue
            for schedule in SCHEDULES:
                for documents in (False, True):
                    interpreted = device == "cpu" and backend == "triton"
                    if interpreted and (executor, schedule, documents) not in INTERPRETED:
                        continue
                    marks = []
                    if device == "cuda":
                        marks.append(pytest.mark.gpu)
                    elif interpreted or (executor == "compiled"
                                         and (schedule, documents) != ("block", False)):
                        # A compile or the interpreter: one compiled row stays in test-fast.
                        marks.append(pytest.mark.slow)
                    words = [device, backend, executor, schedule,
                             "documents" if documents else "whole"]
                    rows.append(pytest.param(device, backend, executor, schedule, documents,
                                             marks=marks, id="-".join(words)))
    return rows


@pytest.mark.parametrize("device,backend,executor,schedule,documents",
                         _rows("cpu") + _rows("cuda"))
def test_the_matrix(device: str, backend: str, executor: str, schedule: str,
                    documents: bool) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch._dynamo.reset()
    where = torch.device(device)
    model = build(backend, "matrix", schedule, executor, where)
    interpreted = device == "cpu" and backend == "triton"
    # Under the interpreter one step, but where the second replays what the first recorded.
    steps = 2 if executor == "graphed" or not interpreted else 1
    check_step(model, "matrix", documents, tolerance(backend, where), where,
               INTERPRETED_LENGTH if interpreted else T, steps)
    if executor == "graphed" and device == "cpu":
        # Two captures (forward, backward) replayed once per training step; the evaluation pass
        # (no autograd: a run of its own) captures and replays its forward.
        capture = model.executor.graphs.capture
        assert (capture.captured, capture.replays) == (3, 2 * steps + 1)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["c3_k2", "gqa", "deep_token_window"])
@pytest.mark.parametrize("backend", ATTENTION)
def test_low_precision_matches_the_reference(backend: str, case: str, dtype: torch.dtype,
                                             atol: float) -> None:
    """float64 checks exactness; float32 and bfloat16 run the same kernels at their precision."""
    logits, _, _ = expected(case, False)
    model = tiny_model(attention=backend, **CASES[case]).to(dtype)
    got = model(tokens(length=T))
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), logits, rtol=0, atol=atol)
