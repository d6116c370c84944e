"""The attention of a stack of query cells over their own keys and the history's finished
groups (spec §3, §7) as ONE family of `torch.library` operators with ONE autograd
registration, whatever computes it: the history's gradient protocol is written here once, and
an implementation supplies only a forward and a backward.

Operators (`ops.custom_op`, fake implementations for tracing), every tensor stacked over cells
on a leading axis (`[cells, B, H, n, d]`; a block is a stack of one, a wave several):

- `megabeta::history_attention(q, k, v, hist_k, hist_v, start, shift, self_bias, lower, state,
  sources, layers, top, window, scale, shift_rows, diag_rows, implementation) -> (out, lse)`,
  differentiable w.r.t. q, k, v, shift and self_bias (`attention`). Its backward leaves the
  groups' share of the history's gradients in `state`, the implementation's history-gradient
  state (a list of tensors it mutates): "cpu" ADDS the groups' key and value gradients into the
  history's gradient buffers `[grad_k, grad_v]`; "triton" fills the pass's reader buffers, from
  which its `history_gradients` forms each row's gradient once every reader is done. Empty:
  no history gradient wanted;
- `megabeta::history_attention_forward(...)`: the same without autograd (tests, benchmarks);
- `megabeta::history_attention_backward(...)`: the gradients, adding into the gradient buffers
  and, when given, writing the biases' per-row gradient sums into `shift_rows, diag_rows` (then
  d_shift and d_self_bias come back empty), in place. No argument has a default
  (`ops.custom_op` says why).

The geometry (`Cells`): the cells are consecutive blocks of n queries, oldest first; `start` (a
one-element int tensor, read inside: one graph for every block) is the newest cell's first
position, cell i's is (cells-1-i)·n rows before; their layers step by a constant, and each
cell's source layers are the newest cell's (`sources`, M(l) of spec §3) moved by its layer's
offset and cut at `top`. Group g of a cell reads rows `group_rows(window, layer, m_g, start)`
of source m_g, its scores minus `shift[cell, g, h]`; `self_bias [cells]` (or None) is added to
the diagonal; `lower [cells, B, n]` (or None) bounds each query's keys below (spec §7). Own keys
`k, v [cells, B, H_kv, nk, d]` may be longer than the queries (decoding, forward only): query r
is own key nk - n + r.

The gradient protocol (`_setup_context`, `_backward`): q, k, v, start, shift, self_bias, lower,
out and lse are saved; the history buffers and the state are HELD, not saved (later units write
the history's rows >= start, which this call never reads, and this very backward writes the
state); lse is not differentiable, and no zero gradient is materialised for it or for an output
that took no part in the loss.

Implementations register by name on import (`register`): "triton"
(`megabeta.kernels.triton_attention`) and "cpu" (`megabeta.kernels.cpu_attention`'s C++
kernels). They return the layouts the fake
implementations promise: out in q's dtype, a transposed view of a contiguous `[cells, B, n, H,
d]` (`empty_outputs`); lse `[cells, B, H, n]` contiguous in `lse_dtype`; dq, dk, dv as
`gradient_like`; d_shift shaped like `shift` and d_self_bias `[cells]` (`[cells, 0]` without a
self bias), in lse's dtype, or both empty when row buffers are given.

(No `from __future__ import annotations` here: `custom_op` infers the schemas from the
annotations.)
"""

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from megabeta.kernels.ops import custom_op


def group_rows(window: int, layer: int, source: int, start: int) -> slice:
    """Rows of source layer `source`'s finished group that queries of `layer` in the block at
    `start` read (spec §3): all before the block, or with deep_token_window w > 0 and a deeper
    source, only the last w of them."""
    return slice(max(0, start - window) if window > 0 and source > layer else 0, start)


@dataclass(frozen=True)
class Cells:
    """The geometry of one call: which layer and source layers each cell has (module doc)."""

    count: int
    groups: int
    """G: the most source layers a cell reads (the newest cell's)."""
    first: int
    """Cell 0's first source layer (0 when G = 0)."""
    step: int
    """The step between a cell's source layers (1 when it has at most one)."""
    top: int
    """The deepest source layer any cell reads."""
    layer: int
    """Cell 0's layer."""
    layer_step: int
    """Cell i's layer (and first source) is cell 0's plus i·layer_step."""

    @staticmethod
    def of(sources: list[int], layers: list[int], top: int) -> "Cells":
        """`sources`: the newest cell's source layers, an arithmetic progression; `layers`: each
        cell's layer, an arithmetic progression; `top`: the deepest source layer."""
        if not layers:
            raise ValueError("history attention: no cells (layers is empty)")
        layer_step = layers[1] - layers[0] if len(layers) > 1 else 0
        if any(b - a != layer_step for a, b in zip(layers, layers[1:])):
            raise ValueError(f"history attention: the cells' layers must step by one "
                             f"constant, got {layers}")
        if not sources:
            return Cells(len(layers), 0, 0, 1, top, layers[0], layer_step)
        step = sources[1] - sources[0] if len(sources) > 1 else 1
        if step <= 0 or any(b - a != step for a, b in zip(sources, sources[1:])):
            raise ValueError(f"history attention: sources must be increasing with one step "
                             f"(M(l) of spec §3), got {sources}")
        if sources[-1] > top:
            raise ValueError(f"history attention: source {sources[-1]} is deeper than top "
                             f"{top}")
        return Cells(len(layers), len(sources), sources[0] + layers[0] - layers[-1], step, top,
                     layers[0], layer_step)

    def sources(self, i: int) -> list[int]:
        """Cell i's source layers."""
        first = self.first + i * self.layer_step
        return [m for m in range(first, first + self.groups * self.step, self.step)
                if m <= self.top]

    def layers(self) -> list[int]:
        return [self.layer + i * self.layer_step for i in range(self.count)]

    def args(self) -> tuple[int, ...]:
        """The kernels' scalar arguments (CELLS, G, src0, src_step, src_top, layer0,
        layer_step)."""
        return (self.count, self.groups, self.first, self.step, self.top, self.layer,
                self.layer_step)


@dataclass(frozen=True)
class Implementation:
    """What computes the operators: `forward(q, k, v, hist_k, hist_v, start, shift, self_bias,
    lower, sources, layers, top, window, scale) -> (out, lse)` and `backward(grad, q, k, v,
    hist_k, hist_v, out, lse, start, shift, self_bias, lower, state, sources, layers, top,
    window, scale, shift_rows, diag_rows) -> (dq, dk, dv, d_shift, d_self_bias)` (module doc:
    layouts, state)."""

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
                         f"megabeta.kernels.triton_attention, 'cpu' by "
                         f"megabeta.kernels.cpu_attention)")
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


@custom_op("history_attention_backward", mutates_args=("state", "shift_rows", "diag_rows"))
def _backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
                 out: Tensor, lse: Tensor, start: Tensor, shift: Tensor,
                 self_bias: Tensor | None, lower: Tensor | None, state: list[Tensor],
                 sources: list[int], layers: list[int], top: int, window: int, scale: float,
                 shift_rows: Tensor | None, diag_rows: Tensor | None,
                 implementation: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return registered(implementation).backward(
        grad, q, k, v, hist_k, hist_v, out, lse, start, shift, self_bias, lower, state,
        sources, layers, top, window, scale, shift_rows, diag_rows)


@_backward_op.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
      out: Tensor, lse: Tensor, start: Tensor, shift: Tensor, self_bias: Tensor | None,
      lower: Tensor | None, state: list[Tensor], sources: list[int], layers: list[int],
      top: int, window: int, scale: float, shift_rows: Tensor | None,
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
                  start: Tensor, shift: Tensor, self_bias: Tensor | None, lower: Tensor | None,
                  state: list[Tensor], sources: list[int], layers: list[int], top: int,
                  window: int, scale: float, shift_rows: Tensor | None,
                  diag_rows: Tensor | None, implementation: str) -> tuple[Tensor, Tensor]:
    return registered(implementation).forward(q, k, v, hist_k, hist_v, start, shift, self_bias,
                                              lower, sources, layers, top, window, scale)


@_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor, start: Tensor,
      shift: Tensor, self_bias: Tensor | None, lower: Tensor | None, state: list[Tensor],
      sources: list[int], layers: list[int], top: int, window: int, scale: float,
      shift_rows: Tensor | None, diag_rows: Tensor | None,
      implementation: str) -> tuple[Tensor, Tensor]:
    registered(implementation)
    return empty_outputs(q)


def _setup_context(ctx: Any, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    (q, k, v, hist_k, hist_v, start, shift, self_bias, lower, state, sources, layers, top,
     window, scale, shift_rows, diag_rows, implementation) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, start, shift, self_bias, lower, out, lse)
    # Held, not saved (module doc).
    ctx.history = (hist_k, hist_v, list(state))
    ctx.rows = (shift_rows, diag_rows)
    ctx.args = (list(sources), list(layers), top, window, scale)
    ctx.implementation = implementation
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad: Tensor | None, _grad_lse: Tensor | None) -> tuple:
    hist_k, hist_v, state = ctx.history
    sources, layers = ctx.args[:2]
    # The inputs' structure: `state` a list (of no gradients), and so is an empty list of ints
    # (torch's autograd takes a non-empty one as a leaf).
    none = ((None,) * 9 + ([None] * len(state),)
            + tuple(None if ints else [] for ints in (sources, layers)) + (None,) * 6)
    if grad is None:  # the output took no part in the loss
        return none
    q, k, v, start, shift, self_bias, lower, out, lse = ctx.saved_tensors
    dq, dk, dv, d_shift, d_self_bias = torch.ops.megabeta.history_attention_backward(
        grad, q, k, v, hist_k, hist_v, out, lse, start, shift, self_bias, lower, state,
        *ctx.args, *ctx.rows, ctx.implementation)
    if ctx.rows[0] is not None:  # the biases' partial sums went to the pass's buffers
        d_shift = d_self_bias = None
    return (dq, dk, dv, None, None, None,
            None if d_shift is None else d_shift.to(shift.dtype),
            None if self_bias is None or d_self_bias is None
            else d_self_bias.to(self_bias.dtype), *none[8:])


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor, start: Tensor,
              shift: Tensor, self_bias: Tensor | None = None, *, state: list[Tensor],
              sources: list[int], layers: list[int], top: int, window: int, scale: float,
              implementation: str, shift_rows: Tensor | None = None,
              diag_rows: Tensor | None = None, lower: Tensor | None = None) -> Tensor:
    """`megabeta::history_attention`'s output `[cells, B, H, n, d]` over stacked cells (module
    doc)."""
    return torch.ops.megabeta.history_attention(
        q, k, v, hist_k, hist_v, start, shift, self_bias, lower, state, sources, layers, top,
        window, scale, shift_rows, diag_rows, implementation)[0]


__all__ = ["Cells", "Implementation", "attention", "empty_outputs", "gradient_like",
           "group_rows", "lse_dtype", "register", "registered", "row_major"]
