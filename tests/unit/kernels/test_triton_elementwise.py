"""The Triton implementation of the elementwise functions (megabeta/kernels/triton_elementwise.py,
through megabeta.kernels.elementwise) against the torch implementation and against float64
formulas written out here, forward and backward, on widths that are not powers of two (masked
tiles), ragged token counts and strided inputs and gradients. Each op is also checked with
`torch.library.opcheck` (schema, fake impl, AOT dispatch; the ops have no gradients of their
own), for one launch each way, and against a perturbed reference that must NOT match (so the
tolerances can fail).

Without a GPU the kernels run under Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), in float32 and float64; bfloat16 only for the dtype rules."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton", reason="triton is not installed: the Triton elementwise kernels "
                                     "(megabeta/kernels/triton_elementwise.py) cannot run")

from megabeta.kernels import elementwise, ops, triton_elementwise as tc  # noqa: E402
from megabeta.model import layers  # noqa: E402

EPS = 1e-5
TRITON = dict(implementation="triton")
THETA = 10_000.0
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _value_and_grads(fn: Callable[..., Tensor | tuple[Tensor, ...]], inputs: list[Tensor],
                     weights: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """`fn`'s outputs and the gradients of `Σ out·weight` w.r.t. `inputs` (fresh leaves, cast
    to the weights' dtype so a float64 reference sees float64 inputs)."""
    leaves = [t.detach().to(weights[0].dtype).requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = list(out) if isinstance(out, tuple) else [out]
    loss = sum((o * w.to(o.dtype)).sum() for o, w in zip(outs, weights))
    return [o.detach() for o in outs], list(torch.autograd.grad(loss, leaves))


def _assert_close(got: list[Tensor], want: list[Tensor], dtype: torch.dtype) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w.to(g.dtype), **TOL[dtype])


def _assert_differs(got: list[Tensor], want: list[Tensor], dtype: torch.dtype) -> None:
    assert not all(torch.allclose(g, w.to(g.dtype), **TOL[dtype]) for g, w in zip(got, want))


def _check(got: tuple, references: list[tuple], mutated: tuple, dtype: torch.dtype) -> None:
    """Values and gradients `got` match every reference and differ from the mutated one."""
    for reference in references:
        _assert_close(got[0] + got[1], reference[0] + reference[1], dtype)
    _assert_differs(got[0], mutated[0], dtype)
    _assert_differs(got[1], mutated[1], dtype)


def _launches(fn: Callable[[], Tensor | tuple[Tensor, ...]]) -> tuple[int, int]:
    """Triton launches of `fn()`'s forward and of its backward."""
    with ops.LaunchCount() as forward:
        out = fn()
    outs = out if isinstance(out, tuple) else (out,)
    with ops.LaunchCount() as backward:
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return forward.total, backward.total


# ---- rms_normalize -----------------------------------------------------------------------------

def _rms64(x: Tensor, mutated: bool = False) -> Tensor:
    """`x / sqrt(mean(x²) + eps)`; mutated: the mean over d + 1 elements."""
    d = x.shape[-1] + (1 if mutated else 0)
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / d + EPS)


def _rms_input(dtype: torch.dtype, strided: bool) -> Tensor:
    # d = 40 and 13: masked tiles. Strided: every other column (last-dim stride 2).
    if strided:
        return _rand(2, 3, 80, seed=1, dtype=dtype)[..., ::2]
    return _rand(7, 13, seed=2, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_normalize_matches_torch_and_float64(dtype: torch.dtype, strided: bool) -> None:
    x = _rms_input(dtype, strided)
    dy = _rand(*x.shape, seed=3, dtype=dtype)
    got = _value_and_grads(lambda t: elementwise.rms_normalize(t, EPS, **TRITON), [x], [dy])
    torch_ref = _value_and_grads(lambda t: elementwise.rms_normalize(t, EPS), [x], [dy])
    exact = _value_and_grads(_rms64, [x], [dy.double()])
    assert got[0][0].dtype == dtype and got[0][0].is_contiguous()
    mutated = _value_and_grads(lambda t: _rms64(t, mutated=True), [x], [dy.double()])
    _check(got, [torch_ref, exact], mutated, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_add_rms_normalize_matches_torch_and_float64(dtype: torch.dtype) -> None:
    # Both outputs feed the loss: the residual stream's gradient is added by the kernel.
    x, delta = _rand(2, 3, 40, seed=20, dtype=dtype), _rand(2, 3, 40, seed=21, dtype=dtype)
    weights = [_rand(2, 3, 40, seed=22, dtype=dtype), _rand(2, 3, 40, seed=23, dtype=dtype)]

    def exact(x: Tensor, delta: Tensor, mutated: bool = False) -> tuple[Tensor, Tensor]:
        return x + delta, _rms64(x + delta, mutated)

    got = _value_and_grads(lambda t, u: elementwise.add_rms_normalize(t, u, EPS, **TRITON),
                           [x, delta], weights)
    want = _value_and_grads(lambda t, u: elementwise.add_rms_normalize(t, u, EPS), [x, delta],
                            weights)
    want64 = _value_and_grads(exact, [x, delta], [w.double() for w in weights])
    assert all(o.dtype == dtype and o.is_contiguous() for o in got[0])
    mutated = _value_and_grads(lambda t, u: exact(t, u, mutated=True), [x, delta],
                               [w.double() for w in weights])
    _check(got, [want, want64], mutated, dtype)


def test_add_rms_normalize_promotes_like_torch() -> None:
    """Under autocast the residual stream is float32 and a projection's output bf16: the sum
    and its norm are float32 as `x + delta` makes them, each input's gradient in its dtype."""
    x = _rand(2, 3, 40, seed=24).requires_grad_()
    delta = _rand(2, 3, 40, seed=25).bfloat16().requires_grad_()
    weights = [_rand(2, 3, 40, seed=26), _rand(2, 3, 40, seed=27)]
    outs = elementwise.add_rms_normalize(x, delta, EPS, **TRITON)
    x_ref, delta_ref = (t.detach().clone().requires_grad_() for t in (x, delta))
    want = elementwise.add_rms_normalize(x_ref, delta_ref, EPS)
    for got, ref in zip(outs, want):
        assert got.dtype == ref.dtype == torch.float32
        torch.testing.assert_close(got, ref)
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    sum((o * w).sum() for o, w in zip(want, weights)).backward()
    assert (x.grad.dtype, delta.grad.dtype) == (torch.float32, torch.bfloat16)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(delta.grad, delta_ref.grad)


# ---- split_heads_rope --------------------------------------------------------------------------

HEAD_DIM = 12  # half = 6: masked tiles


def _torch_split(y: Tensor, cos: Tensor, sin: Tensor, rotary: int) -> tuple[Tensor, Tensor]:
    return elementwise.split_heads_rope(y, cos, sin, rotary_heads=rotary, head_dim=HEAD_DIM)


def _split64(y: Tensor, start: int, rotary: int) -> tuple[Tensor, Tensor]:
    """Each head's halves as one complex number per frequency, `x₁ + i·x₂`, times
    `e^{i·p·θ^(-2j/d_h)}` at position p."""
    half = HEAD_DIM // 2
    n = y.shape[1]
    heads = y.unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2)
    rot, plain = heads[:, :rotary], heads[:, rotary:]
    freq = torch.tensor([THETA ** (-2 * j / HEAD_DIM) for j in range(half)], dtype=torch.float64)
    angle = torch.arange(start, start + n, dtype=torch.float64)[:, None] * freq
    z = torch.complex(rot[..., :half], rot[..., half:]) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1), plain


def _tables(start: int, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    cos, sin = layers.rope_tables(HEAD_DIM, start, n, THETA)
    return cos.to(dtype), sin.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,rotary,plain", [(5, 3, 2), (37, 2, 1), (6, 2, 0)])
def test_split_heads_rope_matches_torch_and_float64(dtype: torch.dtype, n: int, rotary: int,
                                                     plain: int) -> None:
    # n = 37: two token tiles, the second ragged. plain = 0: the last layer's finished K only.
    start, batch = 7, 2
    y = _rand(batch, n, (rotary + plain) * HEAD_DIM, seed=4, dtype=dtype)
    # Strided tables: cos rows of a longer table (as a block's slice), sin column-major.
    cos, sin = _tables(0, start + n + 3, dtype)
    cos, sin = cos[start:start + n], sin[start:start + n].t().contiguous().t()
    # The rotary gradient arrives transposed (strided), as from a consumer of [B, n, H, d_h].
    w_rot = _rand(batch, n, rotary, HEAD_DIM, seed=5, dtype=dtype).transpose(1, 2)
    w_plain = _rand(batch, plain, n, HEAD_DIM, seed=6, dtype=dtype)
    weights = [w_rot, w_plain]

    got = _value_and_grads(lambda t: elementwise.split_heads_rope(
        t, cos, sin, rotary_heads=rotary, head_dim=HEAD_DIM, **TRITON), [y], weights)
    torch_ref = _value_and_grads(lambda t: _torch_split(t, cos, sin, rotary), [y], weights)
    exact = _value_and_grads(lambda t: _split64(t, start, rotary), [y],
                             [w.double() for w in weights])
    assert all(o.is_contiguous() and o.dtype == dtype for o in got[0])
    assert got[0][1].shape == (batch, plain, n, HEAD_DIM)
    # Off by one position: the rotation is checked, not just the split.
    mutated = _value_and_grads(lambda t: _split64(t, start + 1, rotary), [y],
                               [w.double() for w in weights])
    _check(got, [torch_ref, exact], mutated, dtype)


def test_split_heads_rope_dtypes_follow_torch() -> None:
    # bfloat16 projection with float32 tables (autocast): both kinds of heads stay bfloat16,
    # the rotation computed in float32 and rounded once, as the torch implementation does.
    y = _rand(1, 4, 3 * HEAD_DIM, seed=7).bfloat16().requires_grad_()
    cos, sin = _tables(0, 4, torch.float32)
    rot, plain = elementwise.split_heads_rope(y, cos, sin, rotary_heads=2, head_dim=HEAD_DIM,
                                              **TRITON)
    want_rot, want_plain = _torch_split(y, cos, sin, 2)
    assert rot.dtype == plain.dtype == want_rot.dtype == want_plain.dtype == torch.bfloat16
    torch.testing.assert_close(rot, want_rot)
    assert torch.equal(plain, want_plain)
    (rot.sum() + plain.sum()).backward()
    assert y.grad.dtype == torch.bfloat16


def test_split_heads_rope_rejects_bad_shapes() -> None:
    y = torch.zeros(1, 4, 3 * HEAD_DIM)
    cos, sin = _tables(0, 4, torch.float32)
    with pytest.raises(ValueError, match="rotary heads"):
        elementwise.split_heads_rope(y, cos, sin, rotary_heads=4, head_dim=HEAD_DIM, **TRITON)
    with pytest.raises(ValueError, match="cos/sin"):
        elementwise.split_heads_rope(y, cos[:3], sin[:3], rotary_heads=2, head_dim=HEAD_DIM,
                                     **TRITON)


# ---- swiglu ------------------------------------------------------------------------------------

def _swiglu64(gate_up: Tensor, mutated: bool = False) -> Tensor:
    """`g / (1 + e^{-g}) · u`; mutated: gate and up swapped."""
    h = gate_up.shape[-1] // 2
    g, u = gate_up[..., :h], gate_up[..., h:]
    if mutated:
        g, u = u, g
    return g / (1 + torch.exp(-g)) * u


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 3, 40), (3, 2 * 1100)])
def test_swiglu_matches_torch_and_float64(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    # h = 20: a masked tile; h = 1100: two column tiles of 1024, the second ragged.
    gate_up = 3 * _rand(*shape, seed=8, dtype=dtype)
    dout = _rand(*shape[:-1], shape[-1] // 2, seed=9, dtype=dtype)
    got = _value_and_grads(lambda t: elementwise.swiglu(t, **TRITON), [gate_up], [dout])
    torch_ref = _value_and_grads(elementwise.swiglu, [gate_up], [dout])
    exact = _value_and_grads(_swiglu64, [gate_up], [dout.double()])
    assert got[0][0].dtype == dtype and got[0][0].is_contiguous()
    mutated = _value_and_grads(lambda t: _swiglu64(t, mutated=True), [gate_up], [dout.double()])
    _check(got, [torch_ref, exact], mutated, dtype)


@pytest.mark.parametrize("implementation", ["torch", "triton"])
def test_normalized_rows_come_in_the_matmuls_dtype(implementation: str) -> None:
    """`dtype=`: the normalized rows written in the dtype of the matmul that reads them (bf16
    under autocast), equal to the float32 rows cast; the bf16 gradient they bring back is read
    as the cast's backward would hand it, so every input gradient equals the cast pipeline's.
    Bit for bit, but for Triton's CPU interpreter, which rounds to bf16 toward zero (one unit
    in the last place; compiled kernels round to nearest even, as torch does)."""
    bf16 = (dict(rtol=0, atol=0) if implementation == "torch" or torch.cuda.is_available()
            else dict(rtol=2 ** -7, atol=0))
    x = _rand(2, 3, 40, seed=30).requires_grad_()
    delta = _rand(2, 3, 40, seed=31).bfloat16().requires_grad_()
    weights = [_rand(2, 3, 40, seed=32), _rand(2, 3, 40, seed=33).bfloat16()]
    a, y = elementwise.add_rms_normalize(x, delta, EPS, implementation, dtype=torch.bfloat16)
    x_ref, delta_ref = (t.detach().clone().requires_grad_() for t in (x, delta))
    a_ref, y32 = elementwise.add_rms_normalize(x_ref, delta_ref, EPS)
    y_ref = y32.bfloat16()
    assert (a.dtype, y.dtype) == (torch.float32, torch.bfloat16)
    torch.testing.assert_close(y, y_ref, **bf16)
    ((a * weights[0]).sum() + (y * weights[1]).sum()).backward()
    ((a_ref * weights[0]).sum() + (y_ref * weights[1]).sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(delta.grad, delta_ref.grad, **bf16)
    alone = elementwise.rms_normalize(x.detach(), EPS, implementation, dtype=torch.bfloat16)
    torch.testing.assert_close(alone, elementwise.rms_normalize(x.detach(), EPS).bfloat16(),
                               **bf16)


# ---- every op ----------------------------------------------------------------------------------

def _cases() -> dict[str, tuple[Callable[..., object], tuple]]:
    """(op, sample arguments) per custom op (the ops have no gradients of their own:
    megabeta.kernels.elementwise registers them)."""
    cos, sin = _tables(3, 5, torch.float32)
    return {
        "rms_normalize": (tc._rms_normalize_op, (_rand(2, 3, 40, seed=10), EPS)),
        "add_rms_normalize": (tc._add_rms_normalize_op,
                              (_rand(2, 3, 40, seed=24), _rand(2, 3, 40, seed=25), EPS)),
        "rms_normalize_backward": (tc._rms_normalize_backward_op,
                                   (_rand(2, 3, 40, seed=11), None, _rand(2, 3, 40, seed=12),
                                    EPS)),
        "rms_normalize_backward_add": (tc._rms_normalize_backward_op,
                                       (_rand(2, 3, 40, seed=26), _rand(2, 3, 40, seed=27),
                                        _rand(2, 3, 40, seed=28), EPS)),
        "rms_normalize_backward_two": (tc._rms_normalize_backward_op,
                                       (_rand(2, 3, 40, seed=26).bfloat16(),
                                        _rand(2, 3, 40, seed=27), _rand(2, 3, 40, seed=28), EPS,
                                        torch.bfloat16)),
        "rms_normalize_bf16": (tc._rms_normalize_op, (_rand(2, 3, 40, seed=10), EPS,
                                                      torch.bfloat16)),
        "split_heads_rope": (tc.split_heads_rope_forward,
                             (_rand(2, 5, 5 * HEAD_DIM, seed=13), cos, sin, 3, HEAD_DIM)),
        "split_heads_rope_backward": (tc.split_heads_rope_backward,
                                      (_rand(2, 3, 5, HEAD_DIM, seed=14),
                                       _rand(2, 2, 5, HEAD_DIM, seed=15), cos, sin)),
        "swiglu": (tc._swiglu_op, (_rand(2, 3, 40, seed=16),)),
        "swiglu_backward": (tc._swiglu_backward_op,
                            (_rand(2, 3, 20, seed=17), _rand(2, 3, 40, seed=18))),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_opcheck(name: str) -> None:
    op, args = _cases()[name]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                "test_aot_dispatch_dynamic"))


def _functions() -> dict[str, Callable[[], Tensor | tuple[Tensor, ...]]]:
    """Each elementwise function on the Triton implementation, on inputs that require grad."""
    cos, sin = _tables(3, 5, torch.float32)
    x, delta = (_rand(2, 3, 40, seed=seed).requires_grad_() for seed in (30, 31))
    y = _rand(2, 5, 5 * HEAD_DIM, seed=32).requires_grad_()
    return {
        "rms_normalize": lambda: elementwise.rms_normalize(x, EPS, **TRITON),
        "add_rms_normalize": lambda: elementwise.add_rms_normalize(x, delta, EPS, **TRITON),
        "split_heads_rope": lambda: elementwise.split_heads_rope(y, cos, sin, rotary_heads=3,
                                                                 head_dim=HEAD_DIM, **TRITON),
        "swiglu": lambda: elementwise.swiglu(x, **TRITON),
    }


@pytest.mark.parametrize("name", list(_functions()))
def test_one_launch_each_way(name: str) -> None:
    assert _launches(_functions()[name]) == (1, 1)


def test_the_model_reaches_the_ops() -> None:
    # The model calls ElementwiseKernels' functions; they must reach the registered ops (one
    # launch each).
    kernels = layers.ElementwiseKernels.named("triton")
    x = _rand(2, 40, seed=19)
    with ops.LaunchCount() as count:
        kernels.rms_normalize(x, EPS)
        kernels.add_rms_normalize(x, x, EPS)
        kernels.swiglu(x)
        kernels.split_heads_rope(x[None, :, :36], *_tables(0, 2, torch.float32), rotary_heads=1,
                                 head_dim=HEAD_DIM)
    assert count.by_kernel == {"_rms_forward_kernel": 2, "_swiglu_forward_kernel": 1,
                               "_split_rope_forward_kernel": 1}
    # The dispatch counter (megabeta.kernels.ops.DispatchCount) runs each op's Python implementation.
    assert all(ops.implementation(f"megabeta::{name}") is not None for name in (
        "rms_normalize", "add_rms_normalize", "rms_normalize_backward", "split_heads_rope",
        "split_heads_rope_backward", "swiglu", "swiglu_backward"))


# ---- on a CUDA GPU (`pytest -m gpu`) -------------------------------------------------------------

GPU_SHAPES = {
    "small": dict(rows=(2, 9, 40), heads=(2, 9, 3, 2, 8), gate_up=(2, 9, 2 * 24)),
    # t19_flash's widths: d 1600, d_h 200, hidden 3200; one c = 32 block's fused projection:
    # 24 rotary heads, 16 plain.
    "t19": dict(rows=(4, 32, 1600), heads=(4, 32, 24, 16, 200), gate_up=(4, 32, 2 * 3200)),
}
GPU_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
"""max |kernel - float64 reference| over max |reference|, per output and gradient."""


def _bf16_exact(t: Tensor) -> Tensor:
    return t.to(torch.bfloat16).double()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("size", sorted(GPU_SHAPES))
@pytest.mark.parametrize("name", ["rms_normalize", "add_rms_normalize", "split_heads_rope",
                                  "swiglu"])
def test_on_a_gpu_matches_float64(name: str, size: str, dtype: torch.dtype) -> None:
    """Each Triton kernel on the GPU, forward and backward, against the torch implementation
    in float64 on bf16-representable inputs."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    shapes = GPU_SHAPES[size]
    batch, n, rotary, plain, head_dim = shapes["heads"]
    cos, sin = (_bf16_exact(t) for t in layers.rope_tables(head_dim, 100, n, THETA))
    rope = dict(rotary_heads=rotary, head_dim=head_dim)
    cases = {
        "rms_normalize": ([shapes["rows"]], lambda x, **k: elementwise.rms_normalize(x, EPS, **k)),
        "add_rms_normalize": ([shapes["rows"]] * 2,
                              lambda x, d, **k: elementwise.add_rms_normalize(x, d, EPS, **k)),
        "split_heads_rope": ([(batch, n, (rotary + plain) * head_dim)],
                             lambda y, **k: elementwise.split_heads_rope(
                                 y, cos.to(y), sin.to(y), **rope, **k)),
        "swiglu": ([shapes["gate_up"]], lambda x, **k: elementwise.swiglu(x, **k)),
    }
    input_shapes, fn = cases[name]
    gen = torch.Generator().manual_seed(1)
    inputs = [_bf16_exact(torch.randn(*s, generator=gen, dtype=torch.float64))
              for s in input_shapes]
    reference = fn(*inputs)
    outs = reference if isinstance(reference, tuple) else (reference,)
    weights = [_bf16_exact(torch.randn(o.shape, generator=gen, dtype=torch.float64))
               for o in outs]
    want = _value_and_grads(fn, inputs, weights)
    cuda = [t.to("cuda", dtype) for t in inputs]
    got = _value_and_grads(lambda *xs: fn(*xs, **TRITON), cuda,
                           [w.to("cuda", dtype) for w in weights])
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        error = (g.double().cpu() - w).abs().max() / w.abs().max().clamp(min=1e-30)
        assert error <= GPU_TOL[dtype], (name, float(error))
