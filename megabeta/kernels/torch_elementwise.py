"""The `torch` implementation of a cell's elementwise functions (`megabeta.kernels.elementwise`):
forward and backward written out in ATen operators, on any device.

Written out rather than left to autograd because a step runs them thousands of times on small
tensors, where the number of operators decides the time. Autograd through the formulas took,
forward+backward (float32, 2 threads): RMSNorm 1.6x as long at c = 32 ([8, 32, 192]) and
2.4-3.2x at [8, 512, 192]; RoPE 1.7x for a c = 32 block's 9 heads ([8, 9, 32, 64]) and 2-2.2x
for [8, 6, 512, 64]. The split into heads' backward writes both kinds of head gradient straight
into the projection's gradient, where autograd copies the transposed rotary gradient and then
concatenates it with the plain one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_forward(x: Tensor, delta: Tensor | None, eps: float,
                dtype: torch.dtype) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """`(a, y, saved)`: the residual sum `a = x + delta` (x itself without delta),
    `y = a·r` for `r = rsqrt(mean(a²) + eps)` (rounded to `dtype`), and `(y, r)` in a's
    precision for `rms_backward`."""
    a = x if delta is None else x + delta
    r = torch.linalg.vecdot(a, a).unsqueeze(-1).div_(a.shape[-1]).add_(eps).rsqrt_()
    y = a * r
    return a, y.to(dtype), (y, r)


def rms_backward(dy: Tensor, da: Tensor | None, saved: tuple[Tensor, ...], eps: float,
                 delta_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """The gradient of `a`: `r·(dy - y·mean(dy·y))`, plus `da`, `a`'s own, where given; and
    the same in `delta_dtype`."""
    y, r = saved
    dy = dy.to(y.dtype)
    mean = torch.linalg.vecdot(dy, y).unsqueeze(-1).div_(y.shape[-1])
    grad = torch.addcmul(dy, y, mean, value=-1).mul_(r)
    if da is not None:
        grad = grad.add_(da)
    return grad, grad if delta_dtype is None else grad.to(delta_dtype)


def _heads(y: Tensor, rotary_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """`y [B, n, W]` as views `(rotary, plain)`, each `[B, heads, n, d_h]`."""
    width = rotary_heads * head_dim
    rot, plain = y.split([width, y.shape[-1] - width], dim=-1)
    return (rot.unflatten(-1, (rotary_heads, head_dim)).transpose(1, 2),
            plain.unflatten(-1, (-1, head_dim)).transpose(1, 2))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, sign: float, out: Tensor) -> Tensor:
    """`out` (x's shape; any strides and dtype) set to the halves `(x₁c - sign·x₂s,
    x₂c + sign·x₁s)`: RoPE's rotation (sign 1) or its transpose (-1). The tables' halves are
    equal (`layers.rope_tables`).

    Computed in the dtype promoted with the tables', rounded once into `out`'s: under autocast
    the projections are bf16 and the tables float32, and the queries and keys stay bf16 (rounded
    after the rotation) for the attention kernels, which would otherwise run in float32."""
    half = x.shape[-1] // 2
    x1, x2 = x.split(half, dim=-1)
    c, s = cos[..., :half], sin[..., :half]
    if torch.compiler.is_compiling():
        # Traced (the compiled block step): the compiler fuses the elementwise work, and
        # writing into the halves (`out=`) does not trace.
        return out.copy_(torch.cat([x1 * c - sign * x2 * s, x2 * c + sign * x1 * s], dim=-1))
    compute = torch.promote_types(x.dtype, cos.dtype)
    target = out if out.dtype == compute else torch.empty(x.shape, dtype=compute,
                                                          device=x.device)
    out1, out2 = target.split(half, dim=-1)
    torch.mul(x1, c, out=out1).addcmul_(x2, s, value=-sign)
    torch.mul(x2, c, out=out2).addcmul_(x1, s, value=sign)
    return out if target is out else out.copy_(target)


def split_heads_rope_forward(y: Tensor, cos: Tensor, sin: Tensor, rotary_heads: int,
                             head_dim: int) -> tuple[Tensor, Tensor]:
    """`(rotary, plain)` heads of `y [B, n, W]`: the rotary ones rotated into a new contiguous
    tensor, the plain ones views of `y`."""
    rot, plain = _heads(y, rotary_heads, head_dim)
    return _rotate(rot, cos, sin, 1.0, out=rot.new_empty(rot.shape)), plain


def split_heads_rope_backward(drot: Tensor, dplain: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The gradient of `y [B, n, W]`: the rotary heads' rotated back, the plain heads' copied,
    each written into its columns."""
    batch, rotary_heads, n, head_dim = drot.shape
    dy = drot.new_empty((batch, n, (rotary_heads + dplain.shape[1]) * head_dim))
    rot, plain = _heads(dy, rotary_heads, head_dim)
    _rotate(drot, cos, sin, -1.0, out=rot)
    if plain.numel():
        plain.copy_(dplain)
    return dy


def swiglu_forward(gate_up: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    """`silu(gate)·up` for `gate, up = gate_up.chunk(2, dim=-1)`, and `(gate_up, silu(gate))`
    for `swiglu_backward`."""
    gate, up = gate_up.chunk(2, dim=-1)
    activated = F.silu(gate)
    return activated * up, (gate_up, activated)


def swiglu_backward(dout: Tensor, saved: tuple[Tensor, ...]) -> Tensor:
    """The gradient of `gate_up`: `(dout·up·silu'(gate), dout·silu(gate))`."""
    gate_up, activated = saved
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(dout * up, gate), dout * activated], dim=-1)
