"""The device checks of tests/gpu on a CPU: each check function (tests/support/device_checks.py)
passes a right implementation and fails a wrong one, so its tolerance can fail. The Triton
kernels run under Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET) at the
small sizes, in fp32 (its bfloat16 tl.dot is wrong: triton#11584); the model checks run on the
CPU's backends, which share the history, schedule and static-step code the triton backend
uses."""

from __future__ import annotations

import math

import pytest
import torch

from megabeta.model import ExecutionConfig
from megabeta.model.attention.backend import AttentionBias
from support import device_checks as checks
from support.device_checks import (ATTENTION_CASES, GRAD_TOL, KERNEL_TOL, MODEL_TOL, within)

CPU = torch.device("cpu")
FP32 = torch.float32


@pytest.fixture
def triton() -> None:
    pytest.importorskip("triton", reason="triton is not installed: no kernels to check")


def _drop_self_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    from megabeta.kernels import triton_attention

    original = triton_attention.block_attention

    def without_self_bias(q, k, v, hist_k, hist_v, grad_k, grad_v, start, shift, self_bias,
                          **kwargs):
        return original(q, k, v, hist_k, hist_v, grad_k, grad_v, start, shift, None, **kwargs)

    monkeypatch.setattr(triton_attention, "block_attention", without_self_bias)


def test_block_attention_check_fails_a_kernel_that_drops_the_self_bias(
        triton: None, monkeypatch: pytest.MonkeyPatch) -> None:
    case = next(c for c in ATTENTION_CASES if c.name == "gqa+window")
    right = checks.block_attention_errors(case, FP32, CPU)
    assert set(right) == {"out", "d_q", "d_k", "d_v", "d_hist_k", "d_hist_v", "d_shift",
                          "d_self_bias"}
    assert within(right, KERNEL_TOL["fp32"]), right
    _drop_self_bias(monkeypatch)
    wrong = checks.block_attention_errors(case, FP32, CPU)
    assert wrong["out"] > 1e-2  # a visible error, not a rounding one
    assert math.isinf(wrong["d_self_bias"])  # no gradient at all


def test_block_attention_check_of_the_first_block(triton: None) -> None:
    """No history: no history gradients to compare."""
    case = next(c for c in ATTENTION_CASES if c.name == "one block")
    errors = checks.block_attention_errors(case, FP32, CPU)
    assert "d_hist_k" not in errors and within(errors, KERNEL_TOL["fp32"]), errors


def test_cell_kernel_checks_pass_and_fail_a_wrong_swiglu(
        triton: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from megabeta.kernels import triton_elementwise

    for kernel in checks.ELEMENTWISE_KERNELS:
        errors = checks.cell_kernel_errors(kernel, "small", FP32, CPU)
        assert within(errors, KERNEL_TOL["fp32"]), (kernel, errors)
    monkeypatch.setattr(triton_elementwise, "swiglu_forward", lambda gate_up: (
        torch.nn.functional.gelu(gate_up.chunk(2, dim=-1)[0]) * gate_up.chunk(2, dim=-1)[1],
        (gate_up,)))
    assert not within(checks.cell_kernel_errors("swiglu", "small", FP32, CPU),
                      KERNEL_TOL["fp32"])


def test_model_checks_pass_on_a_cpu_backend_and_fail_a_wrong_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The model checks on cpu_flash; then the comparison with the explicit reference with the
    self bias of every layer zeroed in what the backend sees, which must fail."""
    from megabeta.model.attention.merged import CpuMergedAttention

    fields, length, prompt = checks.model_shape("small", "mha")
    tol = MODEL_TOL["fp32"]
    assert within(checks.one_block_errors("cpu_flash", FP32, CPU, fields, length), tol)
    assert within(checks.decoding_errors("cpu_flash", FP32, CPU, fields, length, prompt), tol)
    errors, grads = checks.explicit_errors("cpu_flash", FP32, CPU, fields, length)
    assert within(errors, tol) and within(grads, GRAD_TOL["fp32"]), (errors, grads)

    original = CpuMergedAttention.attend
    monkeypatch.setattr(CpuMergedAttention, "attend", lambda self, q, keys, bias, **kw: original(
        self, q, keys, AttentionBias(bias.slope, torch.zeros_like(bias.self_bias),
                                     bias.group_shift), **kw))
    errors, grads = checks.explicit_errors("cpu_flash", FP32, CPU, fields, length)
    assert not within(errors, tol) and not within(grads, GRAD_TOL["fp32"])


def test_masked_model_checks_pass_and_fail_a_model_that_drops_the_mask(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The document-mask checks (spec §7) on cpu_flash: against the explicit reference, the
    wavefront against the block schedule and the compiled step on cpu_fused; a backend that
    ignores the bounds must fail the first."""
    fields, length, _ = checks.model_shape("small", "gqa+window")
    errors, grads = checks.explicit_errors("cpu_flash", FP32, CPU, fields, length, True)
    assert within(errors, MODEL_TOL["fp32"]) and within(grads, GRAD_TOL["fp32"])
    assert within(checks.wavefront_errors("cpu_flash", FP32, CPU, fields, length, True),
                  GRAD_TOL["fp32"])
    errors, graphs = checks.static_step_errors("cpu_fused", FP32, CPU, fields, length,
                                               "compiled", True)
    assert within(errors, GRAD_TOL["fp32"]) and graphs == 1
    from megabeta.model.attention.merged import CpuMergedAttention

    original = CpuMergedAttention.attend

    def unmasked(self, q, keys, bias, **kw):
        keys.documents = None
        return original(self, q, keys, bias, **kw)

    monkeypatch.setattr(CpuMergedAttention, "attend", unmasked)
    errors, _ = checks.explicit_errors("cpu_flash", FP32, CPU, fields, length, True)
    assert not within(errors, MODEL_TOL["fp32"])


def test_a_check_refuses_a_backend_the_model_does_not_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that maps to another on a device would make a check pass vacuously."""
    build = checks.build_on
    monkeypatch.setattr(checks, "build_on", lambda config, device, execution: build(
        config, device, ExecutionConfig(attention="explicit")))
    fields, length, prompt = checks.model_shape("small", "mha")
    with pytest.raises(AssertionError, match="attention = cpu_flash runs explicit here"):
        checks.decoding_errors("cpu_flash", FP32, CPU, fields, length, prompt)


def test_static_step_check_compares_with_eager_and_counts_graphs() -> None:
    """The compiled static step on cpu_fused (the CPU's static backend): equal to the eager
    loop over two steps, one compiled graph."""
    fields, length, _ = checks.model_shape("small", "mha")
    errors, graphs = checks.static_step_errors("cpu_fused", FP32, CPU, fields, length,
                                               "compiled")
    assert within(errors, GRAD_TOL["fp32"]) and len(errors) == 4, errors
    assert graphs == 1


def test_wavefront_check_compares_with_the_block_schedule(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The wavefront check passes on cpu_flash (GQA with a deep-token window), and fails when
    the wavefront's attention loses the self bias (the block schedule's does not)."""
    from megabeta.model.beta12 import PassWeights

    fields, length, _ = checks.model_shape("small", "gqa+window")
    assert within(checks.wavefront_errors("cpu_flash", FP32, CPU, fields, length),
                  GRAD_TOL["fp32"])
    build = PassWeights.__init__

    def zero_self_bias(self, model, *args, batched=False, **kwargs):
        build(self, model, *args, batched=batched, **kwargs)
        if batched:
            biases = self.pass_biases
            biases.self_bias = torch.zeros_like(biases.self_bias)

    monkeypatch.setattr(PassWeights, "__init__", zero_self_bias)
    assert not within(checks.wavefront_errors("cpu_flash", FP32, CPU, fields, length),
                      GRAD_TOL["fp32"])


def test_error_measure_and_verdict() -> None:
    nan = torch.tensor([1.0, float("nan")])
    assert math.isnan(checks.rel_err(nan, torch.ones(2)))
    assert not within({"out": checks.rel_err(nan, torch.ones(2))}, 1.0)
    assert checks.rel_err(torch.zeros(3), torch.zeros(2)) == math.inf
    assert checks.rel_err(torch.full((2,), 1e-9), torch.zeros(2)) == math.inf
    assert checks.rel_err(torch.full((2,), 1e-9), torch.zeros(2),
                          floor=1e-3) == pytest.approx(1e-6)
    assert not within({"a": 1e-5, "b": 2e-4}, 1e-4)
    assert within({"a": 1e-5}, 1e-4) and not within({}, 1e-4)
    with pytest.raises(AssertionError, match=r"worst b 0.0002 > tol 0.0001; beyond tol: "
                                             r"\{'b': '0.0002'\}"):
        checks.assert_within({"a": 1e-5, "b": 2e-4}, 1e-4)
