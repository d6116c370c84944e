"""A Transformer cell's elementwise functions, each with one gradient registration whatever
implements it: RMSNorm with the residual add fused in (`add_rms_normalize`, and
`rms_normalize` without the add), the split into heads with RoPE (`split_heads_rope`), SwiGLU
(`swiglu`).

An implementation is a module of forward and backward functions (`Implementation`), named by
`execution.elementwise_kernels`: `torch` (`megabeta.kernels.torch_elementwise`, ATen
operators on any device) or `triton` (`megabeta.kernels.triton_elementwise`, one fused kernel
launch each way, as custom ops; it imports triton, so it is loaded only when named). Each
function is one `torch.autograd.Function` that calls the named implementation's forward and,
for the gradient, its backward with what the forward saved (torch keeps the norm's statistics,
Triton recomputes them from the input in its backward launch).

An autograd Function rather than a custom op taking the implementation's name: the torch split
returns its plain heads as views of the projection output, which a custom op's outputs may not
be (a copy per projection); torch.compile traces through a Function, so Inductor fuses the torch
implementation's operators, where a custom op would be opaque; and behind a custom op's Python
dispatch the torch RMSNorm of a c = 32 block ([8, 32, 192]) took 1.5-1.6x as long
forward+backward on CPU. The Triton kernels are custom ops themselves (opaque to the compiler,
counted by `megabeta.bench.dispatch`), without gradients of their own.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from megabeta.kernels import torch_elementwise

IMPLEMENTATIONS = ("torch", "triton")


class Implementation(Protocol):
    """The forward and backward functions of an implementation (a module). `saved`: tensors
    the forward keeps for its backward, whatever that backward needs."""

    def rms_forward(self, x: Tensor, delta: Tensor | None, eps: float,
                    dtype: torch.dtype) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """`(a, rms_normalize(a), saved)` for `a = x + delta` (x itself without delta), the
        normalized rows in `dtype`."""

    def rms_backward(self, dy: Tensor, da: Tensor | None, saved: tuple[Tensor, ...],
                     eps: float, delta_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
        """The gradient of `a` (in a's dtype): the norm's, plus `da` where given; and the same
        in `delta_dtype` (a itself where that is a's dtype or None)."""

    def split_heads_rope_forward(self, y: Tensor, cos: Tensor, sin: Tensor, rotary_heads: int,
                                 head_dim: int) -> tuple[Tensor, Tensor]:
        """`(rotary, plain)` heads of `y`, as `split_heads_rope` returns them."""

    def split_heads_rope_backward(self, drot: Tensor, dplain: Tensor, cos: Tensor,
                                  sin: Tensor) -> Tensor:
        """The gradient of `y` (contiguous, in the head gradients' dtype, which is y's)."""

    def swiglu_forward(self, gate_up: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        """`(silu(gate)·up, saved)`."""

    def swiglu_backward(self, dout: Tensor, saved: tuple[Tensor, ...]) -> Tensor:
        """The gradient of `gate_up`."""


_loaded: dict[str, Implementation] = {"torch": torch_elementwise}


def load(name: str) -> Implementation:
    """The implementation `name` (one of IMPLEMENTATIONS), imported on first use."""
    found = _loaded.get(name)
    if found is None:
        if name not in IMPLEMENTATIONS:
            raise ValueError(f"unknown elementwise implementation {name!r}; one of "
                             f"{', '.join(IMPLEMENTATIONS)}")
        found = _loaded[name] = importlib.import_module(f"megabeta.kernels.{name}_elementwise")
    return found


class _AddRMSNormalize(torch.autograd.Function):
    """`y = rms_normalize(a)` for `a = x + delta`, returning `(a, y)`; without delta only `y`
    (a is x); y in `dtype` (None: a's). Backward: the norm's gradient plus `a`'s own, given to x
    and to delta (each in its dtype: under autocast the stream is float32 and a projection's
    output bf16; the implementation writes both)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, delta: Tensor | None, eps: float, name: str,
                dtype: torch.dtype | None) -> Tensor | tuple[Tensor, Tensor]:
        ctx.implementation = implementation = load(name)
        a_dtype = x.dtype if delta is None else torch.promote_types(x.dtype, delta.dtype)
        a, y, saved = implementation.rms_forward(x, delta, eps, dtype or a_dtype)
        ctx.save_for_backward(*saved)
        ctx.eps = eps
        if delta is None:
            ctx.dtypes = None
            return y
        ctx.dtypes = x.dtype, delta.dtype
        # An unused `a` brings no gradient: no zeros to add.
        ctx.set_materialize_grads(False)
        return a, y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        if ctx.dtypes is None:
            grad = ctx.implementation.rms_backward(grads[0], None, ctx.saved_tensors, ctx.eps,
                                                   None)[0]
            return grad, None, None, None, None
        da, dy = grads
        x_dtype, delta_dtype = ctx.dtypes
        if dy is None:
            if da is None:
                return None, None, None, None, None
            grad, grad_delta = da, da.to(delta_dtype)
        else:
            grad, grad_delta = ctx.implementation.rms_backward(dy, da, ctx.saved_tensors,
                                                               ctx.eps, delta_dtype)
        return grad.to(x_dtype), grad_delta, None, None, None


def _or_zeros(grad: Tensor | None, like: tuple[torch.Size, torch.dtype, torch.device]) -> Tensor:
    """`grad`, or zeros shaped like the output it is the gradient of, where that was unused."""
    if grad is not None:
        return grad
    shape, dtype, device = like
    # Without elements there is nothing to fill.
    return (torch.zeros if shape.numel() else torch.empty)(shape, dtype=dtype, device=device)


class _SplitHeadsRope(torch.autograd.Function):
    """`(rotary, plain)` heads of `y`; backward the gradient of `y` (the tables get none)."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, cos: Tensor, sin: Tensor, rotary_heads: int,
                head_dim: int, name: str) -> tuple[Tensor, Tensor]:
        ctx.implementation = implementation = load(name)
        rot, plain = implementation.split_heads_rope_forward(y, cos, sin, rotary_heads, head_dim)
        ctx.save_for_backward(cos, sin)
        ctx.outputs = [(t.shape, t.dtype, t.device) for t in (rot, plain)]
        # Only a missing gradient of a non-empty output costs a zero fill (RoPE alone, as
        # `layers.apply_rope`, has no plain heads).
        ctx.set_materialize_grads(False)
        return rot, plain

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, drot: Tensor | None,
                 dplain: Tensor | None) -> tuple[Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        drot, dplain = (_or_zeros(g, like) for g, like in zip((drot, dplain), ctx.outputs))
        dy = ctx.implementation.split_heads_rope_backward(drot, dplain, cos, sin)
        return dy, None, None, None, None, None


class _SwiGLU(torch.autograd.Function):
    """`silu(gate)·up` of `gate_up`; backward the gradient of `gate_up`."""

    @staticmethod
    def forward(ctx: Any, gate_up: Tensor, name: str) -> Tensor:
        ctx.implementation = implementation = load(name)
        out, saved = implementation.swiglu_forward(gate_up)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor, None]:
        return ctx.implementation.swiglu_backward(dout, ctx.saved_tensors), None


def rms_normalize(x: Tensor, eps: float, implementation: str = "torch", *,
                  dtype: torch.dtype | None = None) -> Tensor:
    """`x · rsqrt(mean(x²) + eps)` over the last dimension: RMSNorm without its weight (the
    model folds the weight into the next matmul). Computed in x's precision and rounded once
    to `dtype` (default x's): the dtype of the matmul that reads it, so no cast follows."""
    return _AddRMSNormalize.apply(x, None, eps, implementation, dtype)


def add_rms_normalize(x: Tensor, delta: Tensor, eps: float, implementation: str = "torch", *,
                      dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """`(a, rms_normalize(a))` for the residual sum `a = x + delta` (in the dtype torch
    promotes the two to), the normalized rows in `dtype` (default a's)."""
    return _AddRMSNormalize.apply(x, delta, eps, implementation, dtype)


def split_heads_rope(y: Tensor, cos: Tensor, sin: Tensor, *, rotary_heads: int, head_dim: int,
                     implementation: str = "torch") -> tuple[Tensor, Tensor]:
    """A projection's output `y [B, n, W]` as heads `(rotary, plain)`, `[B, heads, n, d_h]`, in
    y's dtype: the first `rotary_heads` heads rotated by RoPE (rotate-half) at the positions
    whose tables `cos/sin [n, d_h]` (`layers.rope_tables`, equal halves) were sliced, the rest
    as they are. The tables get no gradient."""
    return _SplitHeadsRope.apply(y, cos, sin, rotary_heads, head_dim, implementation)


def swiglu(gate_up: Tensor, implementation: str = "torch") -> Tensor:
    """`silu(gate) · up` for `gate, up = gate_up.chunk(2, dim=-1)`: `[..., 2h] → [..., h]`."""
    return _SwiGLU.apply(gate_up, implementation)
