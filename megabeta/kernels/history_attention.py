"""The attention of blocks over their own keys and the history's finished groups (spec §3) as ONE
family of `torch.library` operators with ONE autograd registration, whatever computes it: the
history's gradient protocol is written here once, and an implementation supplies only a forward
and a backward.

Operators (`ops.custom_op`, fake implementations for tracing), every tensor stacked over cells
on a leading axis (`[cells, B, H, n, d]`; a block is a stack of one, a wave of the wavefront
schedule several: `triton_attention`'s module doc, "Cells"):

- `megabeta::history_attention(q, k, v, hist_k, hist_v, grad_hist_k, grad_hist_v, start, shift,
  self_bias, lower, anchor, sources, layers, top, window, scale, shift_rows, diag_rows,
  implementation) -> (out, lse)`, differentiable w.r.t. q, k, v, shift and self_bias
  (`attention`; `block` for one block). Its backward ADDS the groups' key and value gradients
  into `grad_hist_k, grad_hist_v`;
- `megabeta::history_attention_forward(q, k, v, hist_k, hist_v, start, shift, self_bias, lower,
  sources, layers, top, window, scale, implementation) -> (out, lse)`: the same without autograd
  (for tests and benchmarks);
- `megabeta::history_attention_backward(grad, q, k, v, hist_k, hist_v, out, lse, start, shift,
  self_bias, lower, grad_hist_k, grad_hist_v, sources, layers, top, window, scale, shift_rows,
  diag_rows, implementation) -> (dq, dk, dv, d_shift, d_self_bias)`: adds into
  `grad_hist_k, grad_hist_v` and, when given, writes the biases' per-row gradient sums into
  `shift_rows, diag_rows` (then d_shift and d_self_bias are empty), in place. No argument has a
  default (`ops.custom_op` says why).

The arguments are `triton_attention.wave_attention`'s (its doc and `triton_attention.forward`'s
have them in full): `shift [cells, G', H]` is subtracted from group g's scores of head h
(entries past a cell's groups unused), `self_bias [cells]` (or None) added to the diagonal
score, `lower [cells, B, n]` (or None) the document bounds (spec §7), `start` the last cell's
first position as a one-element int tensor, read inside (one graph for every block).

The gradient protocol (`_setup_context`, `_backward`):

- q, k, v, start, shift, self_bias, lower, out and lse are saved; the history buffers and their
  gradient buffers are HELD, not saved: later blocks write the history's rows >= start, which
  this call never reads (the saved-tensor version check would refuse what is correct), and
  this very backward writes the gradient buffers;
- `anchor` is an input only so that autograd runs this backward before the anchor's
  producer's (history.py); it gets `ops.anchor_gradient`;
- lse is not differentiable, and no zero gradient is materialised for it or for an output that
  took no part in the loss (a launch per call otherwise).

Implementations register by name on import (`register`), each from its own module:
"triton" (`megabeta.kernels.triton_attention`: Triton kernels, any number of cells) and
"cpu_fused" (`megabeta.model.attention.merged_op`: the fused C++ kernels on CPU, one cell).
Their forward and backward take the operators' arguments less those of the protocol (the
forward: no gradient buffers, anchor, row buffers) and return the layouts the fake
implementations promise: out in q's dtype, a transposed view of a contiguous
`[cells, B, n, H, d]` (`empty_outputs`); lse `[cells, B, H, n]` contiguous in `lse_dtype`;
dq, dk, dv as `gradient_like`; d_shift shaped like `shift` and d_self_bias `[cells]`
(`[cells, 0]` without a self bias), both in lse's dtype, or both empty when row buffers are
given.

(No `from __future__ import annotations` here: `custom_op` infers the schemas from the
annotations.)
"""

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from megabeta.kernels.ops import anchor_gradient, custom_op


@dataclass(frozen=True)
class Implementation:
    """What computes the operators: `forward(q, k, v, hist_k, hist_v, start, shift, self_bias,
    lower, sources, layers, top, window, scale) -> (out, lse)` and `backward(grad, q, k, v,
    hist_k, hist_v, out, lse, start, shift, self_bias, lower, grad_hist_k, grad_hist_v, sources,
    layers, top, window, scale, shift_rows, diag_rows) -> (dq, dk, dv, d_shift, d_self_bias)`
    (module doc: layouts)."""

    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]


_REGISTERED: dict[str, Implementation] = {}


def register(name: str, *, forward: Callable[..., tuple[Tensor, Tensor]],
             backward: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]) -> None:
    """Make `name` an implementation the operators take (called by its module on import)."""
    _REGISTERED[name] = Implementation(forward, backward)


def registered(name: str) -> Implementation:
    """The implementation `name`; a ValueError naming the registered ones otherwise."""
    found = _REGISTERED.get(name)
    if found is None:
        known = ", ".join(repr(n) for n in sorted(_REGISTERED)) or "none"
        raise ValueError(f"history attention: no implementation {name!r} (registered: {known}; "
                         f"each registers when its module is imported: 'triton' by "
                         f"megabeta.kernels.triton_attention, 'cpu_fused' by "
                         f"megabeta.model.attention.merged_op)")
    return found


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The lse's dtype for queries of `dtype`: the accumulation's (float32; float64 for
    float64)."""
    return torch.promote_types(dtype, torch.float32)


def empty_outputs(q: Tensor) -> tuple[Tensor, Tensor]:
    """New `out` (q's dtype, a transposed view of a contiguous `[cells, B, n, H, d]`: the caller
    merges the heads with a view) and `lse` `[cells, B, H, n]` for queries `q`."""
    cells, batch, heads, n, width = q.shape
    return (q.new_empty(cells, batch, n, heads, width).transpose(2, 3),
            q.new_empty(cells, batch, heads, n, dtype=lse_dtype(q.dtype)))


def row_major(t: Tensor) -> Tensor:
    """`t` with a contiguous last dimension (kernels read rows of d numbers)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def gradient_like(t: Tensor) -> Tensor:
    """A new tensor laid out like `row_major(t)`: the gradient of q, k or v."""
    return torch.empty_like(row_major(t))


@custom_op("history_attention_forward")
def _forward_op(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor, start: Tensor,
                shift: Tensor, self_bias: Tensor | None, lower: Tensor | None,
                sources: list[int], layers: list[int], top: int, window: int, scale: float,
                implementation: str) -> tuple[Tensor, Tensor]:
    return registered(implementation).forward(q, k, v, hist_k, hist_v, start, shift, self_bias,
                                              lower, sources, layers, top, window, scale)


@_forward_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor, start: Tensor,
      shift: Tensor, self_bias: Tensor | None, lower: Tensor | None, sources: list[int],
      layers: list[int], top: int, window: int, scale: float,
      implementation: str) -> tuple[Tensor, Tensor]:
    registered(implementation)
    return empty_outputs(q)


@custom_op("history_attention_backward",
           mutates_args=("grad_hist_k", "grad_hist_v", "shift_rows", "diag_rows"))
def _backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
                 out: Tensor, lse: Tensor, start: Tensor, shift: Tensor,
                 self_bias: Tensor | None, lower: Tensor | None, grad_hist_k: Tensor,
                 grad_hist_v: Tensor, sources: list[int], layers: list[int], top: int,
                 window: int, scale: float, shift_rows: Tensor | None,
                 diag_rows: Tensor | None,
                 implementation: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return registered(implementation).backward(
        grad, q, k, v, hist_k, hist_v, out, lse, start, shift, self_bias, lower, grad_hist_k,
        grad_hist_v, sources, layers, top, window, scale, shift_rows, diag_rows)


@_backward_op.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
      out: Tensor, lse: Tensor, start: Tensor, shift: Tensor, self_bias: Tensor | None,
      lower: Tensor | None, grad_hist_k: Tensor, grad_hist_v: Tensor, sources: list[int],
      layers: list[int], top: int, window: int, scale: float, shift_rows: Tensor | None,
      diag_rows: Tensor | None,
      implementation: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    registered(implementation)
    grads = gradient_like(q), gradient_like(k), gradient_like(v)
    if shift_rows is not None:
        return *grads, lse.new_empty(0), lse.new_empty(0)
    cells = len(layers)
    return (*grads, lse.new_empty(shift.shape),
            lse.new_empty(cells if self_bias is not None else (cells, 0)))


@custom_op("history_attention")
def _attention_op(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
                  grad_hist_k: Tensor, grad_hist_v: Tensor, start: Tensor, shift: Tensor,
                  self_bias: Tensor | None, lower: Tensor | None, anchor: Tensor | None,
                  sources: list[int], layers: list[int], top: int, window: int, scale: float,
                  shift_rows: Tensor | None, diag_rows: Tensor | None,
                  implementation: str) -> tuple[Tensor, Tensor]:
    return registered(implementation).forward(q, k, v, hist_k, hist_v, start, shift, self_bias,
                                              lower, sources, layers, top, window, scale)


@_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor, grad_hist_k: Tensor,
      grad_hist_v: Tensor, start: Tensor, shift: Tensor, self_bias: Tensor | None,
      lower: Tensor | None, anchor: Tensor | None, sources: list[int], layers: list[int],
      top: int, window: int, scale: float, shift_rows: Tensor | None, diag_rows: Tensor | None,
      implementation: str) -> tuple[Tensor, Tensor]:
    registered(implementation)
    return empty_outputs(q)


def _setup_context(ctx: Any, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    (q, k, v, hist_k, hist_v, grad_hist_k, grad_hist_v, start, shift, self_bias, lower,
     anchor, sources, layers, top, window, scale, shift_rows, diag_rows, implementation) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, start, shift, self_bias, lower, out, lse)
    # Held, not saved (module doc): later blocks write the history's rows >= start, which this
    # call never reads, and this very backward writes the gradient buffers.
    ctx.history = (hist_k, hist_v, grad_hist_k, grad_hist_v)
    ctx.rows = (shift_rows, diag_rows)
    ctx.args = (list(sources), list(layers), top, window, scale)
    ctx.implementation = implementation
    ctx.anchor = None if anchor is None else (anchor.dtype, anchor.device)
    ctx.mark_non_differentiable(lse)
    # No zero-filled gradient for lse (nobody differentiates it): a launch per call.
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad: Tensor | None, _grad_lse: Tensor | None) -> tuple:
    if grad is None:  # the output took no part in the loss
        return (None,) * 20
    q, k, v, start, shift, self_bias, lower, out, lse = ctx.saved_tensors
    hist_k, hist_v, grad_hist_k, grad_hist_v = ctx.history
    dq, dk, dv, d_shift, d_self_bias = torch.ops.megabeta.history_attention_backward(
        grad, q, k, v, hist_k, hist_v, out, lse, start, shift, self_bias, lower, grad_hist_k,
        grad_hist_v, *ctx.args, *ctx.rows, ctx.implementation)
    if ctx.rows[0] is not None:  # the biases' partial sums went to the pass's buffers
        d_shift = d_self_bias = None
    return (dq, dk, dv, None, None, None, None, None,
            None if d_shift is None else d_shift.to(shift.dtype),
            None if self_bias is None or d_self_bias is None
            else d_self_bias.to(self_bias.dtype),
            None, anchor_gradient(ctx.anchor), None, None, None, None, None, None, None, None)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
              grad_hist_k: Tensor, grad_hist_v: Tensor, start: Tensor, shift: Tensor,
              self_bias: Tensor | None = None, *, sources: list[int], layers: list[int],
              top: int, window: int, scale: float, implementation: str,
              anchor: Tensor | None = None, shift_rows: Tensor | None = None,
              diag_rows: Tensor | None = None, lower: Tensor | None = None) -> Tensor:
    """`megabeta::history_attention`'s output `[cells, B, H, n, d]` over stacked cells
    (`triton_attention.wave_attention` documents the arguments)."""
    return torch.ops.megabeta.history_attention(
        q, k, v, hist_k, hist_v, grad_hist_k, grad_hist_v, start, shift, self_bias, lower,
        anchor, sources, layers, top, window, scale, shift_rows, diag_rows, implementation)[0]


def block(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor, grad_hist_k: Tensor,
          grad_hist_v: Tensor, start: Tensor, shift: Tensor, self_bias: Tensor | None = None, *,
          sources: list[int], layer: int, window: int, scale: float, implementation: str,
          anchor: Tensor | None = None, shift_rows: Tensor | None = None,
          diag_rows: Tensor | None = None, lower: Tensor | None = None) -> Tensor:
    """`attention` of one block at `layer`, its tensors without the cell axis (`q [B, H, n, d]`,
    `shift [G, H]`, `self_bias [1]`, `lower [B, n]`, `shift_rows [G, B, H, T]`, `diag_rows
    [B, H, T]`; `triton_attention.block_attention` documents them): `[B, H, n, d]`."""
    return attention(
        q[None], k[None], v[None], hist_k, hist_v, grad_hist_k, grad_hist_v, start, shift[None],
        self_bias, sources=sources, layers=[layer], top=block_top(sources, layer), window=window,
        scale=scale, implementation=implementation, anchor=anchor, shift_rows=one(shift_rows),
        diag_rows=one(diag_rows), lower=one(lower)).squeeze(0)


def one(x: Tensor | None) -> Tensor | None:
    """One block's tensor as a stack of one cell (and `squeeze(0)` back: a view whose gradient is
    one too, where indexing's would be a zero-filled copy)."""
    return None if x is None else x[None]


def block_top(sources: list[int], layer: int) -> int:
    """The deepest source layer of one block (its layer when it has none)."""
    return sources[-1] if sources else layer
