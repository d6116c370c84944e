"""The building blocks with hand-written backward passes (model/layers.py) against their
formulas (spec §1: RMSNorm, rotate-half RoPE) and against finite differences."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megabeta.kernels.ops import DispatchCount
from megabeta.model.layers import (StackedWeight, apply_rope, batched_matmul, linear,
                                   rms_normalize, rope_tables, stacked_linear)


def _heads(*shape: int) -> torch.Tensor:
    """A float64 `[B, heads, n, d]` that is a transposed view, as the projections hand out."""
    b, h, n, d = shape
    return torch.randn(b, n, h, d, dtype=torch.float64).transpose(1, 2).requires_grad_()


def test_rms_normalize_matches_its_formula_and_finite_differences() -> None:
    torch.manual_seed(0)
    x = _heads(2, 3, 5, 8)
    naive = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(rms_normalize(x, 1e-5), naive, rtol=0, atol=1e-14)
    assert torch.autograd.gradcheck(lambda t: rms_normalize(t, 1e-5), (x,))


def test_rope_matches_rotate_half_and_finite_differences() -> None:
    torch.manual_seed(0)
    x = _heads(2, 3, 5, 8)
    cos, sin = rope_tables(8, 7, 5, 10000.0)
    half = 4
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    torch.testing.assert_close(apply_rope(x, cos, sin), x * cos + rotated * sin,
                               rtol=0, atol=1e-14)
    # Row i is position 7 + i; pair (j, j + 4) turns by the angle (7 + i)·10000^(-2j/8).
    angle = 9 * 10000.0 ** (-2 / 8)
    a, b = x[0, 0, 2, 1].item(), x[0, 0, 2, 5].item()
    expected = torch.tensor([a * math.cos(angle) - b * math.sin(angle),
                             b * math.cos(angle) + a * math.sin(angle)], dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, cos, sin)[0, 0, 2, [1, 5]], expected,
                               rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin), (x,))


def test_rope_computes_in_the_tables_precision_and_keeps_the_input_dtype() -> None:
    """Under autocast the projections are bf16 and the tables float32: the rotation is computed
    in float32 and rounded once to bf16 (the attention kernels then read bf16), forward and
    backward."""
    x = torch.randn(1, 2, 3, 4, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = (t.float() for t in rope_tables(4, 0, 3, 10000.0))
    y = apply_rope(x, cos, sin)
    assert y.dtype == torch.bfloat16
    wide = x.detach().float().requires_grad_()
    want = apply_rope(wide, cos, sin)
    assert torch.equal(y, want.bfloat16())
    grad = torch.randn(y.shape, dtype=torch.bfloat16)
    y.backward(grad)
    want.backward(grad.float())
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, wide.grad.bfloat16())


@pytest.mark.parametrize("dtype,autocast", [(torch.float64, False), (torch.bfloat16, True),
                                            (torch.float32, True)])
def test_one_layers_weight_is_f_linear(dtype: torch.dtype, autocast: bool) -> None:
    """`linear` with a weight of one layer (`StackedWeight.one`, gradients by autograd): the
    weight's and bias's gradients over three calls equal autograd's through F.linear."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5, 4, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(5, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    xs = [torch.randn(2, 3, 4, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        shared_w, shared_b = StackedWeight.one(w * 2), StackedWeight.one(b * 3)
        loss = sum((linear(x, shared_w, shared_b) * (i + 1)).sum() for i, x in enumerate(xs))
        want = sum((F.linear(x, w * 2, b * 3) * (i + 1)).sum() for i, x in enumerate(xs))
    want_w, want_b = torch.autograd.grad(want, (w, b))
    loss.backward()
    tol = dict(atol=0, rtol=1e-12) if dtype == torch.float64 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(w.grad, want_w, **tol)
    torch.testing.assert_close(b.grad, want_b, **tol)


@pytest.mark.parametrize("form", ["pass", "call"])
@pytest.mark.parametrize("even", [True, False], ids=["even", "uneven"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_by_hand_stacks_form_the_passes_gradient(dtype: torch.dtype, even: bool,
                                                 form: str) -> None:
    """By-hand stacks (beta12's passes): calls on strided views of one stack give the stack's
    and the bias's gradients as autograd gives them through plain batched matmuls, whether the
    calls keep their rows for one product over the pass (`pass`; in bf16 one rounding of the
    pass's sum) or each adds its product at once (`call`; bf16 products summed in float32). A
    call whose output takes no part in the loss adds nothing; entries that saw unequal numbers
    of rows (`uneven`) take the pass form's per-entry path."""
    gen = torch.Generator().manual_seed(1)
    layers, rows = 4, 6
    w = torch.randn(layers, 5, 3, generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn(layers, 5, generator=gen, dtype=torch.float64).to(dtype)
    calls = [slice(0, 4, 2), slice(1, 4, 2), slice(0, 4, 2), slice(1, 4, 2),
             *(slice(e, e + 1) for e in (0, 0, 1, 1, 2, 2, 3, 3))]
    if not even:
        calls = calls[:-1]
    xs = [torch.randn(len(range(layers)[sel]), rows, 3, generator=gen,
                      dtype=torch.float64).to(dtype) for sel in calls]
    stack, bias = StackedWeight(w, gradients=form), StackedWeight(b, gradients=form)
    ws, bs = w.clone().requires_grad_(), b.clone().requires_grad_()
    leaves = [x.clone().requires_grad_() for x in xs]
    loss = want = 0
    for i, (sel, x) in enumerate(zip(calls, leaves)):
        loss = loss + (stacked_linear(x, stack, sel, bias) * (i + 1)).sum()
        want = want + (torch.baddbmm(bs[sel].unsqueeze(1), x.detach(),
                                     ws[sel].transpose(1, 2)) * (i + 1)).sum()
    # Outside the loss: its backward never runs.
    stacked_linear(torch.randn(1, rows, 3, dtype=dtype), stack, slice(2, 3), bias)
    loss.backward()
    want_w, want_b = torch.autograd.grad(want, (ws, bs))
    tol = dict(atol=0, rtol=1e-12) if dtype == torch.float64 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(stack.gradient(), want_w, **tol)
    torch.testing.assert_close(bias.bias_gradient(), want_b, **tol)
    want_x = [torch.bmm(torch.full((len(range(layers)[sel]), rows, 5), float(i + 1),
                                   dtype=dtype), w[sel]) for i, sel in enumerate(calls)]
    for x, want_dx in zip(leaves, want_x):
        torch.testing.assert_close(x.grad, want_dx, **tol)


@pytest.mark.parametrize("entries", [1, 2, 3, 5])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_batched_matmul_is_each_entrys_product(entries: int, bias: bool) -> None:
    """Per entry, with or without a bias, as one batched matmul or, for the CPU kernels' stacks
    (`per_entry`, 2 threads: odd counts), one matmul each; the weights a transposed stack view,
    as they are read."""
    gen = torch.Generator().manual_seed(entries)
    a = torch.randn(entries, 5, 7, generator=gen, dtype=torch.float64)
    stack = torch.randn(entries + 1, 3, 7, generator=gen, dtype=torch.float64)
    b = stack[1:].transpose(1, 2)
    c = torch.randn(entries, 3, generator=gen, dtype=torch.float64) if bias else None
    want = torch.stack([a[i] @ b[i] + (c[i] if bias else 0) for i in range(entries)])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for per_entry in (False, True):
            with DispatchCount() as count:
                got = batched_matmul(a, b, c, per_entry=per_entry)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            one_each = per_entry and entries % 2 == 1 and entries > 1
            assert sum(count.by_op[op] for op in ("mm", "addmm")) == \
                (entries if one_each else 0), count.by_op
    finally:
        torch.set_num_threads(threads)
