"""The `triton` implementation of a cell's elementwise functions (`megabeta.kernels.elementwise`):
fused Triton kernels.

A beta_1.2 training step runs every layer once per block of c = 32 tokens: thousands of cells
per sequence, each a few small tensors, so on a GPU the number of kernel launches, not the
arithmetic, decides the time. The torch implementation (`megabeta.kernels.torch_elementwise`)
takes several ATen operators per step (RMSNorm five forward and four back, RoPE four each way,
SwiGLU two forward and four back, plus the copies that transposed head views cost wherever a
contiguous layout is needed).
Here each forward and each backward is one `torch.library` custom op (`megabeta::…`, registered
through `megabeta.kernels.ops.custom_op`, launched through `ops.launch` so launches are counted)
that makes ONE Triton launch; the gradients are registered once, for every implementation, in
`megabeta.kernels.elementwise`:

- `rms_normalize`: `x·rsqrt(mean(x²) + eps)` over the last dimension (RMSNorm without its
  weight, which the model folds into the next matmul), one program per row. Backward
  `dx = r·(dy - y·mean(dy·y))` from the saved INPUT: the kernel re-derives `r` and `y` from `x`
  in the same pass that reads `dy`, so no statistics tensor has to be an extra output, and the
  backward works from the unrounded `y` for bfloat16.
- `add_rms_normalize`: the same with the residual add fused in, `(a, rms_normalize(a))` for
  `a = x + delta`. Forward the residual's add (or addmm) becomes part of the norm's launch and
  `W_O·o` a plain matmul; backward the kernel adds the residual stream's own gradient to the
  norm's, so no separate sum of the stream's two gradients (one ATen add per residual, two per
  cell) is launched.
- `split_heads_rope`: the projection output `[B, n, W]` split into rotary heads, rotated
  (rotate-half RoPE), and plain heads, both written as contiguous `[B, heads, n, d_h]` by one
  launch (the torch path's transposed views would cost a copy wherever a contiguous layout is
  needed). Backward: one launch writing `dy [B, n, W]` (the rotation's transpose for the rotary
  heads, a copy for the plain ones), reading the head gradients through their strides.
- `swiglu`: `silu(gate)·up` from the fused gate/up matmul output (gate the first half of the
  last dimension, up the second), and one launch back to `d gate_up`.

Arithmetic is in float32 (float64 for float64 tensors, so a float64 model stays exact); results
are rounded once to the output dtype. Widths need not be powers of two (d = 1600, d_h = 200 in
t19_flash): each kernel masks a power-of-two tile. Inputs may be strided (strides are kernel
arguments; Triton specialises unit strides), outputs are contiguous.

Importing this module needs `triton`. Without a GPU the kernels run under Triton's CPU
interpreter (`TRITON_INTERPRET=1`, set before import), which is how the tests run them.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from megabeta.kernels.ops import custom_op, launch


def _compute_type(dtype: torch.dtype) -> Any:
    """The kernels' arithmetic type for tensors of `dtype`."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _num_warps(tile: int) -> int:
    """Warps for a tile of `tile` elements: about 256 elements a warp, 1 to 8 warps."""
    return min(max(tile // 256, 1), 8)


# ---- RMSNorm without weight --------------------------------------------------------------------

@triton.jit
def _rms_forward_kernel(X, DELTA, A, Y, stride_xm, stride_xd, stride_dm, stride_dd, d, eps,
                        BLOCK_D: tl.constexpr, COMPUTE: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < d
    x = tl.load(X + row * stride_xm + cols * stride_xd, mask=mask, other=0.0).to(COMPUTE)
    if ADD:
        # The residual sum, rounded to its dtype first: the norm sees what the stream stores.
        delta = tl.load(DELTA + row * stride_dm + cols * stride_dd, mask=mask, other=0.0)
        a = (x + delta.to(COMPUTE)).to(A.dtype.element_ty)
        tl.store(A + row * d + cols, a, mask=mask)
        x = a.to(COMPUTE)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
    tl.store(Y + row * d + cols, (x * r).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_backward_kernel(DY, GA, X, DX, DDELTA, stride_gm, stride_gd, stride_am, stride_ad,
                         stride_xm, stride_xd, d, eps,
                         BLOCK_D: tl.constexpr, COMPUTE: tl.constexpr, ADD: tl.constexpr,
                         TWO: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < d
    x = tl.load(X + row * stride_xm + cols * stride_xd, mask=mask, other=0.0).to(COMPUTE)
    dy = tl.load(DY + row * stride_gm + cols * stride_gd, mask=mask, other=0.0).to(COMPUTE)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
    y = x * r
    dx = r * (dy - y * (tl.sum(dy * y, axis=0) / d))
    if ADD:
        # The residual stream's own gradient, summed here instead of by autograd (one add less).
        dx += tl.load(GA + row * stride_am + cols * stride_ad, mask=mask, other=0.0).to(COMPUTE)
    tl.store(DX + row * d + cols, dx.to(DX.dtype.element_ty), mask=mask)
    if TWO:
        # The branch's copy in its own dtype (bf16 under autocast): no cast launch after.
        tl.store(DDELTA + row * d + cols, dx.to(DDELTA.dtype.element_ty), mask=mask)


def _rows(t: Tensor) -> Tensor:
    """`t` as rows `[M, d]` over its last dimension (a view where its layout allows)."""
    return t.reshape(-1, t.shape[-1])


def _rms_meta(x: Tensor, add: bool, dtype: torch.dtype, **flags: bool) -> dict[str, Any]:
    """Tile settings for rows like `x`'s, computed in `dtype`'s arithmetic."""
    block = triton.next_power_of_2(x.shape[-1])
    return dict(BLOCK_D=block, COMPUTE=_compute_type(dtype), ADD=add,
                num_warps=_num_warps(block), **flags)


def _rms_forward(x: Tensor, delta: Tensor | None, eps: float,
                 dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """`(x + delta, rms_normalize(x + delta))`, or `(x, rms_normalize(x))` without delta; the
    sum in its dtype (`_sum_dtype`), the normalized rows in `dtype` (None: the sum's)."""
    rows = _rows(x)
    # Without delta the kernel's ADD branch is compiled out; x stands in for its pointers.
    a, deltas = ((x, rows) if delta is None
                 else (x.new_empty(x.shape, dtype=_sum_dtype(x, delta)), _rows(delta)))
    y = a.new_empty(x.shape, dtype=dtype or a.dtype)
    launch(_rms_forward_kernel, (rows.shape[0],), rows, deltas, a, y, *rows.stride(),
           *deltas.stride(), rows.shape[1], eps, **_rms_meta(x, delta is not None, a.dtype))
    return a, y


def _rms_backward_launch(dy: Tensor, da: Tensor | None, x: Tensor, eps: float,
                         delta_dtype: torch.dtype | None) -> tuple[Tensor, Tensor | None]:
    """`d/dx` of `rms_normalize(x)` for the output gradient `dy`, plus `da` where given; and
    the same in `delta_dtype` where given and not x's (else None)."""
    rows, grads = _rows(x), _rows(dy)
    stream = grads if da is None else _rows(da)
    dx = x.new_empty(x.shape)
    two = delta_dtype is not None and delta_dtype != x.dtype
    ddelta = x.new_empty(x.shape, dtype=delta_dtype) if two else None
    launch(_rms_backward_kernel, (rows.shape[0],), grads, stream, rows, dx,
           dx if ddelta is None else ddelta, *grads.stride(), *stream.stride(), *rows.stride(),
           rows.shape[1], eps, **_rms_meta(x, da is not None, x.dtype, TWO=two))
    return dx, ddelta


@custom_op("rms_normalize")
def _rms_normalize_op(x: Tensor, eps: float, dtype: torch.dtype | None = None) -> Tensor:
    return _rms_forward(x, None, eps, dtype)[1]


@_rms_normalize_op.register_fake
def _(x: Tensor, eps: float, dtype: torch.dtype | None = None) -> Tensor:
    return x.new_empty(x.shape, dtype=dtype or x.dtype)


def _check_add(x: Tensor, delta: Tensor) -> None:
    if x.shape != delta.shape:
        raise ValueError(f"add_rms_normalize: x {tuple(x.shape)} and delta "
                         f"{tuple(delta.shape)} must have one shape")


def _sum_dtype(x: Tensor, delta: Tensor) -> torch.dtype:
    """The residual sum's dtype, torch's promotion of the two: under autocast the stream is
    float32 and a projection's output `delta` bf16."""
    return torch.promote_types(x.dtype, delta.dtype)


@custom_op("add_rms_normalize")
def _add_rms_normalize_op(x: Tensor, delta: Tensor, eps: float,
                          dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    _check_add(x, delta)
    return _rms_forward(x, delta, eps, dtype)


@_add_rms_normalize_op.register_fake
def _(x: Tensor, delta: Tensor, eps: float,
      dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    _check_add(x, delta)
    summed = _sum_dtype(x, delta)
    return x.new_empty(x.shape, dtype=summed), x.new_empty(x.shape, dtype=dtype or summed)


@custom_op("rms_normalize_backward")
def _rms_normalize_backward_op(dy: Tensor, da: Tensor | None, a: Tensor, eps: float,
                               delta_dtype: torch.dtype | None = None) -> list[Tensor]:
    """`[d/da]`, or `[d/da, the same in delta_dtype]` where that is not a's dtype."""
    return [t for t in _rms_backward_launch(dy, da, a, eps, delta_dtype) if t is not None]


@_rms_normalize_backward_op.register_fake
def _(dy: Tensor, da: Tensor | None, a: Tensor, eps: float,
      delta_dtype: torch.dtype | None = None) -> list[Tensor]:
    two = delta_dtype is not None and delta_dtype != a.dtype
    return [a.new_empty(a.shape), *([a.new_empty(a.shape, dtype=delta_dtype)] if two else [])]


def rms_forward(x: Tensor, delta: Tensor | None, eps: float,
                dtype: torch.dtype) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """`(a, rms_normalize(a), (a,))` for the residual sum `a = x + delta` (one shape; the sum in
    the dtype torch promotes the two to), or `(x, rms_normalize(x), (x,))` without delta: one
    launch, the add fused into the norm, the normalized rows written in `dtype`. Results
    contiguous; statistics float32 (float64 for float64 tensors)."""
    if delta is None:
        return x, _rms_normalize_op(x, eps, dtype), (x,)
    a, y = _add_rms_normalize_op(x, delta, eps, dtype)
    return a, y, (a,)


def rms_backward(dy: Tensor, da: Tensor | None, saved: tuple[Tensor, ...], eps: float,
                 delta_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """The gradient of `a` from the saved `a` alone: one launch, which also adds `da`, the
    residual stream's own gradient, in the same pass, and writes the gradient a second time
    in `delta_dtype` where that differs from a's."""
    grads = _rms_normalize_backward_op(dy, da, saved[0], eps, delta_dtype)
    return grads[0], grads[-1]


# ---- split into heads + RoPE -------------------------------------------------------------------

@triton.jit
def _split_rope_forward_kernel(Y, COS, SIN, ROT, PLAIN, n, rotary_heads, half,
                               stride_yb, stride_yn, stride_yw, stride_cn, stride_cd,
                               stride_sn, stride_sd,
                               BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr,
                               COMPUTE: tl.constexpr):
    # One program: BLOCK_N tokens of one head of one batch row, as two half-width tiles.
    block = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (rows < n)[:, None] & (cols < half)[None, :]
    src = (Y + b * stride_yb + rows[:, None] * stride_yn
           + (head * 2 * half + cols[None, :]) * stride_yw)
    x1 = tl.load(src, mask=mask, other=0.0).to(COMPUTE)
    x2 = tl.load(src + half * stride_yw, mask=mask, other=0.0).to(COMPUTE)
    # Outputs are contiguous [B, heads, n, d_h]: (b·heads + head)·n + row, times d_h.
    if head < rotary_heads:
        # The tables' two halves are equal (layers.rope_tables): only the first is read.
        c = tl.load(COS + rows[:, None] * stride_cn + cols[None, :] * stride_cd, mask=mask,
                    other=0.0).to(COMPUTE)
        s = tl.load(SIN + rows[:, None] * stride_sn + cols[None, :] * stride_sd, mask=mask,
                    other=0.0).to(COMPUTE)
        dst = ROT + ((b * rotary_heads + head) * n + rows[:, None]) * (2 * half) + cols[None, :]
        tl.store(dst, (x1 * c - x2 * s).to(ROT.dtype.element_ty), mask=mask)
        tl.store(dst + half, (x2 * c + x1 * s).to(ROT.dtype.element_ty), mask=mask)
    else:
        plain_heads = tl.num_programs(1) - rotary_heads
        dst = (PLAIN + ((b * plain_heads + head - rotary_heads) * n + rows[:, None]) * (2 * half)
               + cols[None, :])
        tl.store(dst, x1.to(PLAIN.dtype.element_ty), mask=mask)
        tl.store(dst + half, x2.to(PLAIN.dtype.element_ty), mask=mask)


@triton.jit
def _split_rope_backward_kernel(DROT, DPLAIN, COS, SIN, DY, n, rotary_heads, half,
                                stride_rb, stride_rh, stride_rn, stride_rd,
                                stride_pb, stride_ph, stride_pn, stride_pd,
                                stride_cn, stride_cd, stride_sn, stride_sd,
                                BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr,
                                COMPUTE: tl.constexpr):
    block = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    heads = tl.num_programs(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (rows < n)[:, None] & (cols < half)[None, :]
    # dy is contiguous [B, n, heads·d_h].
    dst = DY + (b * n + rows[:, None]) * (heads * 2 * half) + head * 2 * half + cols[None, :]
    if head < rotary_heads:
        src = (DROT + b * stride_rb + head * stride_rh + rows[:, None] * stride_rn
               + cols[None, :] * stride_rd)
        g1 = tl.load(src, mask=mask, other=0.0).to(COMPUTE)
        g2 = tl.load(src + half * stride_rd, mask=mask, other=0.0).to(COMPUTE)
        c = tl.load(COS + rows[:, None] * stride_cn + cols[None, :] * stride_cd, mask=mask,
                    other=0.0).to(COMPUTE)
        s = tl.load(SIN + rows[:, None] * stride_sn + cols[None, :] * stride_sd, mask=mask,
                    other=0.0).to(COMPUTE)
        # The rotation's transpose: rotate by the opposite angle.
        tl.store(dst, (g1 * c + g2 * s).to(DY.dtype.element_ty), mask=mask)
        tl.store(dst + half, (g2 * c - g1 * s).to(DY.dtype.element_ty), mask=mask)
    else:
        src = (DPLAIN + b * stride_pb + (head - rotary_heads) * stride_ph
               + rows[:, None] * stride_pn + cols[None, :] * stride_pd)
        # Names of their own: the compiler types a name once across both branches, and these
        # keep the gradients' dtype (a copy) where the rotation computes in COMPUTE.
        copy1 = tl.load(src, mask=mask, other=0.0)
        copy2 = tl.load(src + half * stride_pd, mask=mask, other=0.0)
        tl.store(dst, copy1.to(DY.dtype.element_ty), mask=mask)
        tl.store(dst + half, copy2.to(DY.dtype.element_ty), mask=mask)


def _split_shapes(y: Tensor, cos: Tensor, sin: Tensor, rotary_heads: int,
                  head_dim: int) -> tuple[int, int, int]:
    """`(B, n, plain_heads)` of a valid `split_heads_rope` call; ValueError otherwise."""
    if y.dim() != 3:
        raise ValueError(f"split_heads_rope: y must be [B, n, W], got shape {tuple(y.shape)}")
    batch, n, width = y.shape
    if (head_dim <= 0 or head_dim % 2 or width % head_dim
            or not 0 <= rotary_heads * head_dim <= width):
        raise ValueError(f"split_heads_rope: width {width} is not {rotary_heads} rotary heads "
                         f"plus whole plain heads of even width {head_dim}")
    if cos.shape != (n, head_dim) or sin.shape != (n, head_dim):
        raise ValueError(f"split_heads_rope: cos/sin must be [{n}, {head_dim}], got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != sin.dtype:
        raise ValueError(f"split_heads_rope: cos is {cos.dtype} but sin is {sin.dtype}")
    return batch, n, width // head_dim - rotary_heads


def _split_launch_args(batch: int, n: int, heads: int, head_dim: int,
                       dtype: torch.dtype) -> tuple[tuple[int, int, int], dict[str, Any]]:
    """Grid (token tiles, heads, batch) and tile settings for `dtype` arithmetic: up to 32
    tokens a tile (a c = 32 block is one program per head and batch row)."""
    block_n = min(triton.next_power_of_2(n), 32)
    block_half = triton.next_power_of_2(head_dim // 2)
    meta = dict(BLOCK_N=block_n, BLOCK_HALF=block_half, COMPUTE=_compute_type(dtype),
                num_warps=_num_warps(block_n * block_half))
    return (triton.cdiv(n, block_n), heads, batch), meta


def _split_outputs(y: Tensor, cos: Tensor, sin: Tensor, rotary_heads: int,
                   head_dim: int) -> tuple[Tensor, Tensor]:
    """Empty contiguous `(rotary [B, Hr, n, d_h], plain [B, Hp, n, d_h])` in `y`'s dtype."""
    batch, n, plain_heads = _split_shapes(y, cos, sin, rotary_heads, head_dim)
    return (y.new_empty((batch, rotary_heads, n, head_dim)),
            y.new_empty((batch, plain_heads, n, head_dim)))


@custom_op("split_heads_rope")
def split_heads_rope_forward(y: Tensor, cos: Tensor, sin: Tensor, rotary_heads: int,
                             head_dim: int) -> tuple[Tensor, Tensor]:
    """`(rotary, plain)` heads of `y [B, n, W]`, both contiguous, written by one launch.

    The tables may have any floating dtype the device supports; pass them in `y`'s dtype (as
    `DecoderLM.rope` does) or float32, not float64 on a GPU. The rotation is computed in float32
    (float64 where `y` or the tables are) and both outputs have `y`'s dtype."""
    rot, plain = _split_outputs(y, cos, sin, rotary_heads, head_dim)
    batch, n, _ = y.shape
    grid, meta = _split_launch_args(batch, n, rotary_heads + plain.shape[1], head_dim,
                                    torch.promote_types(y.dtype, cos.dtype))
    launch(_split_rope_forward_kernel, grid, y, cos, sin, rot, plain, n, rotary_heads,
           head_dim // 2, *y.stride(), *cos.stride(), *sin.stride(), **meta)
    return rot, plain


@split_heads_rope_forward.register_fake
def _(y: Tensor, cos: Tensor, sin: Tensor, rotary_heads: int,
      head_dim: int) -> tuple[Tensor, Tensor]:
    return _split_outputs(y, cos, sin, rotary_heads, head_dim)


def _split_gradient(drot: Tensor, dplain: Tensor) -> Tensor:
    """Empty contiguous `dy [B, n, W]` in the head gradients' dtype."""
    batch, rotary_heads, n, head_dim = drot.shape
    return drot.new_empty((batch, n, (rotary_heads + dplain.shape[1]) * head_dim))


@custom_op("split_heads_rope_backward")
def split_heads_rope_backward(drot: Tensor, dplain: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The gradient of `y`, one launch, reading the head gradients through their strides."""
    dy = _split_gradient(drot, dplain)
    batch, rotary_heads, n, head_dim = drot.shape
    grid, meta = _split_launch_args(batch, n, rotary_heads + dplain.shape[1], head_dim,
                                    torch.promote_types(drot.dtype, cos.dtype))
    launch(_split_rope_backward_kernel, grid, drot, dplain, cos, sin, dy, n, rotary_heads,
           head_dim // 2, *drot.stride(), *dplain.stride(), *cos.stride(), *sin.stride(),
           **meta)
    return dy


@split_heads_rope_backward.register_fake
def _(drot: Tensor, dplain: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _split_gradient(drot, dplain)


# ---- SwiGLU ------------------------------------------------------------------------------------

@triton.jit
def _gate_up_tile(GU, stride_m, stride_w, h, BLOCK_H: tl.constexpr, COMPUTE: tl.constexpr):
    """This program's row, columns, column mask, and its gate and up tiles of `GU [rows, 2h]`."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < h
    src = GU + row * stride_m + cols * stride_w
    gate = tl.load(src, mask=mask, other=0.0).to(COMPUTE)
    up = tl.load(src + h * stride_w, mask=mask, other=0.0).to(COMPUTE)
    return row, cols, mask, gate, up


@triton.jit
def _swiglu_forward_kernel(GU, OUT, stride_m, stride_w, h,
                           BLOCK_H: tl.constexpr, COMPUTE: tl.constexpr):
    row, cols, mask, gate, up = _gate_up_tile(GU, stride_m, stride_w, h, BLOCK_H, COMPUTE)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(OUT + row * h + cols, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(DOUT, GU, DGU, stride_gm, stride_gw, stride_m, stride_w, h,
                            BLOCK_H: tl.constexpr, COMPUTE: tl.constexpr):
    row, cols, mask, gate, up = _gate_up_tile(GU, stride_m, stride_w, h, BLOCK_H, COMPUTE)
    dout = tl.load(DOUT + row * stride_gm + cols * stride_gw, mask=mask, other=0.0).to(COMPUTE)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    # silu'(g) = σ(g)·(1 + g·(1 - σ(g)))
    dgate = dout * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dout * gate * sig
    dst = DGU + row * 2 * h + cols
    tl.store(dst, dgate.to(DGU.dtype.element_ty), mask=mask)
    tl.store(dst + h, dup.to(DGU.dtype.element_ty), mask=mask)


def _swiglu_launch_args(gate_up: Tensor) -> tuple[Tensor, tuple[int, int], dict[str, Any]]:
    """`gate_up` as rows `[M, 2h]`, the grid, and the tile settings (up to 1024 columns)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension ({gate_up.shape[-1]}) must be even")
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    h = rows.shape[1] // 2
    block = min(triton.next_power_of_2(h), 1024)
    meta = dict(BLOCK_H=block, COMPUTE=_compute_type(gate_up.dtype), num_warps=_num_warps(block))
    return rows, (rows.shape[0], triton.cdiv(h, block)), meta


@custom_op("swiglu")
def _swiglu_op(gate_up: Tensor) -> Tensor:
    rows, grid, meta = _swiglu_launch_args(gate_up)
    out = gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
    launch(_swiglu_forward_kernel, grid, rows, out, *rows.stride(), rows.shape[1] // 2, **meta)
    return out


@_swiglu_op.register_fake
def _(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@custom_op("swiglu_backward")
def _swiglu_backward_op(dout: Tensor, gate_up: Tensor) -> Tensor:
    rows, grid, meta = _swiglu_launch_args(gate_up)
    grad_rows = dout.reshape(rows.shape[0], -1)
    dgu = gate_up.new_empty(gate_up.shape)
    launch(_swiglu_backward_kernel, grid, grad_rows, rows, dgu, *grad_rows.stride(),
           *rows.stride(), rows.shape[1] // 2, **meta)
    return dgu


@_swiglu_backward_op.register_fake
def _(dout: Tensor, gate_up: Tensor) -> Tensor:
    return gate_up.new_empty(gate_up.shape)


def swiglu_forward(gate_up: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    """`silu(gate) · up` (contiguous, `gate_up`'s dtype) in one launch, and `(gate_up,)`."""
    return _swiglu_op(gate_up), (gate_up,)


def swiglu_backward(dout: Tensor, saved: tuple[Tensor, ...]) -> Tensor:
    """`d gate_up` from the saved `gate_up`, one launch."""
    return _swiglu_backward_op(dout, saved[0])
