"""The elementwise functions' one gradient registration each (megabeta/kernels/elementwise.py):
the torch implementation against plain autograd through the formulas (float64, to rounding) and
against finite differences; outputs left unused (no gradient arriving for them) on every
implementation; the dtype rules under autocast; and no copy where a layout allows a view.
The Triton implementation's kernels are checked in detail in test_triton_elementwise.py."""

from __future__ import annotations

import importlib.util
from typing import Callable

import pytest
import torch
from torch import Tensor

from megabeta.kernels.ops import DispatchCount
from megabeta.kernels import elementwise
from megabeta.model.layers import apply_rope, rope_tables

EPS = 1e-5
HEAD_DIM = 8
F64 = dict(rtol=1e-12, atol=1e-12)
IMPLEMENTATIONS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"))]


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _value_and_grads(fn: Callable[..., Tensor | tuple[Tensor, ...]], inputs: list[Tensor],
                     weights: list[Tensor | None]) -> list[Tensor]:
    """`fn`'s outputs and the gradients of `Σ out·weight` w.r.t. `inputs` (fresh leaves); an
    output whose weight is None is left out of the loss (it gets no gradient)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = list(out) if isinstance(out, tuple) else [out]
    loss = sum((o * w).sum() for o, w in zip(outs, weights, strict=True) if w is not None)
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, leaves))


def _assert_close(got: list[Tensor], want: list[Tensor], **tol: float) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **(tol or F64))


def _naive_rms(x: Tensor, mean_over: int | None = None) -> Tensor:
    """`x · rsqrt(mean(x²) + eps)`; `mean_over`: a wrong divisor, for the check that fails."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) / (mean_over or x.shape[-1]) + EPS)


def _naive_split(y: Tensor, cos: Tensor, sin: Tensor, rotary: int) -> tuple[Tensor, Tensor]:
    """Split into heads, rotate-half RoPE on the first `rotary`: `x·cos + (-x₂, x₁)·sin`."""
    heads = y.unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2)
    rot, plain = heads[:, :rotary], heads[:, rotary:]
    half = HEAD_DIM // 2
    turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return rot * cos + turned * sin, plain


def _naive_swiglu(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def test_rms_normalize_and_the_residual_add_match_autograd() -> None:
    x, delta = _rand(3, 4, 24, seed=0), _rand(3, 4, 24, seed=1)
    dy, da = _rand(3, 4, 24, seed=2), _rand(3, 4, 24, seed=3)
    got = _value_and_grads(lambda t: elementwise.rms_normalize(t, EPS), [x], [dy])
    _assert_close(got, _value_and_grads(_naive_rms, [x], [dy]))
    got = _value_and_grads(lambda t, u: elementwise.add_rms_normalize(t, u, EPS), [x, delta],
                           [da, dy])
    _assert_close(got, _value_and_grads(lambda t, u: (t + u, _naive_rms(t + u)), [x, delta],
                                        [da, dy]))
    wrong = _value_and_grads(lambda t: _naive_rms(t, mean_over=25), [x], [dy])
    with pytest.raises(AssertionError):
        _assert_close(_value_and_grads(lambda t: elementwise.rms_normalize(t, EPS), [x], [dy]),
                      wrong)


@pytest.mark.parametrize("rotary", [3, 5], ids=["rotary+plain", "rotary only"])
def test_split_heads_rope_matches_autograd(rotary: int) -> None:
    y = _rand(2, 6, 5 * HEAD_DIM, seed=4)
    cos, sin = rope_tables(HEAD_DIM, 9, 6, 10_000.0)
    # The rotary gradient arrives transposed, as from a consumer of [B, n, H, d_h].
    weights = [_rand(2, 6, rotary, HEAD_DIM, seed=5).transpose(1, 2),
               _rand(2, 5 - rotary, 6, HEAD_DIM, seed=6)]
    got = _value_and_grads(lambda t: elementwise.split_heads_rope(
        t, cos, sin, rotary_heads=rotary, head_dim=HEAD_DIM), [y], weights)
    _assert_close(got, _value_and_grads(lambda t: _naive_split(t, cos, sin, rotary), [y],
                                        weights))
    # One position off: the rotation is checked, not just the split.
    shifted = rope_tables(HEAD_DIM, 10, 6, 10_000.0)
    with pytest.raises(AssertionError):
        _assert_close(got, _value_and_grads(lambda t: _naive_split(t, *shifted, rotary), [y],
                                            weights))


def test_swiglu_matches_autograd() -> None:
    gate_up, dout = 3 * _rand(3, 4, 2 * 20, seed=7), _rand(3, 4, 20, seed=8)
    got = _value_and_grads(elementwise.swiglu, [gate_up], [dout])
    _assert_close(got, _value_and_grads(_naive_swiglu, [gate_up], [dout]))
    swapped = _value_and_grads(lambda t: _naive_swiglu(t.roll(20, dims=-1)), [gate_up], [dout])
    with pytest.raises(AssertionError):
        _assert_close(got, swapped)


def test_gradients_match_finite_differences() -> None:
    x, delta = (_rand(2, 3, 6, seed=s).requires_grad_() for s in (9, 10))
    cos, sin = rope_tables(HEAD_DIM, 2, 3, 10_000.0)
    y = _rand(2, 3, 3 * HEAD_DIM, seed=11).requires_grad_()
    gate_up = _rand(2, 3, 8, seed=12).requires_grad_()
    gradcheck = torch.autograd.gradcheck
    assert gradcheck(lambda t: elementwise.rms_normalize(t, EPS), (x,))
    assert gradcheck(lambda t, u: elementwise.add_rms_normalize(t, u, EPS), (x, delta))
    assert gradcheck(lambda t: elementwise.split_heads_rope(t, cos, sin, rotary_heads=2,
                                                            head_dim=HEAD_DIM), (y,))
    assert gradcheck(elementwise.swiglu, (gate_up,))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_unused_outputs_get_no_gradient(implementation: str) -> None:
    """Only the norm read (the stream's own gradient absent), only the stream read, only the
    rotary heads read: each gradient as autograd's through the formulas."""
    x, delta = _rand(2, 3, 24, seed=13), _rand(2, 3, 24, seed=14)
    w = _rand(2, 3, 24, seed=15)

    def add(t: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
        return elementwise.add_rms_normalize(t, u, EPS, implementation=implementation)

    for weights in ([None, w], [w, None]):
        _assert_close(_value_and_grads(add, [x, delta], weights),
                      _value_and_grads(lambda t, u: (t + u, _naive_rms(t + u)), [x, delta],
                                       weights))
    y = _rand(2, 3, 3 * HEAD_DIM, seed=16)
    cos, sin = rope_tables(HEAD_DIM, 0, 3, 10_000.0)
    weights = [_rand(2, 2, 3, HEAD_DIM, seed=17), None]
    got = _value_and_grads(lambda t: elementwise.split_heads_rope(
        t, cos, sin, rotary_heads=2, head_dim=HEAD_DIM, implementation=implementation), [y],
        weights)
    _assert_close(got, _value_and_grads(lambda t: _naive_split(t, cos, sin, 2), [y], weights))


def test_the_residual_sum_follows_torch_promotion() -> None:
    """Under autocast the stream is float32 and a projection's output bf16: the sum and its norm
    are float32, each input's gradient in its own dtype."""
    x = _rand(2, 3, 16, seed=18, dtype=torch.float32).requires_grad_()
    delta = _rand(2, 3, 16, seed=19, dtype=torch.float32).bfloat16().requires_grad_()
    a, y = elementwise.add_rms_normalize(x, delta, EPS)
    assert a.dtype == y.dtype == torch.float32
    (a.sum() + y.sum()).backward()
    assert (x.grad.dtype, delta.grad.dtype) == (torch.float32, torch.bfloat16)
    torch.testing.assert_close(delta.grad, x.grad.bfloat16())


def test_rope_on_a_projections_heads_copies_nothing() -> None:
    """`apply_rope` on heads laid out as a projection's (`[B, n, H, d_h]` in memory, as the
    qk_norm path hands them over): the rotation's four operators each way, no copy."""
    heads = _rand(2, 3, 4 * HEAD_DIM, seed=20).unflatten(-1, (4, HEAD_DIM)).transpose(1, 2)
    heads.requires_grad_()
    cos, sin = rope_tables(HEAD_DIM, 0, 3, 10_000.0)
    with DispatchCount() as forward:
        out = apply_rope(heads, cos, sin)
    grad = torch.ones_like(out)
    with DispatchCount() as backward:
        out.backward(grad)
    assert forward.by_op == backward.by_op == {"mul": 2, "addcmul_": 2}


def test_an_unknown_implementation_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown elementwise implementation 'cuda'"):
        elementwise.swiglu(torch.zeros(2, 4), implementation="cuda")
