"""`cpu_fused`'s merged attention as `torch.library` operators that read the history buffers at a
start held in a tensor: what the static block step (beta12.py, `block_step`) calls on CPU.

The eager block loop hands `merged.merged_cells` its groups as views sliced at a Python int
(`history.HistoryView.batches`), which a traced graph would bake in: one graph per block. These
operators take the whole buffers `[L, B, H_kv, T, d_h]` and the block's first position as a 0-d
tensor, and slice inside, where no tracer looks, so every block of a sequence has the same
graph, as with the Triton kernels (`megabeta/kernels/triton_attention.py`, the same contract:
the gradient buffers are held and added to in backward, not saved; this one also takes the
document bounds, spec §7). The work
itself is `merged.cells_forward` / `cells_backward` (one cell, on `CPU_FUSED`), so the result
is the eager path's, bit for bit.

`torch.ops.megabeta.merged_attention(q, k, v, hist_k, hist_v, grad_hist_k, grad_hist_v, start,
lower, self_bias, slope, anchor, sources, layer, window, scale)` returns `(out, lse)`: the output
`[B, H, n, d_h]` of the block's queries at `layer` over its own keys and the finished groups of
`sources` (history rows before `start`, a 0-d int64 tensor), with b_σ = `self_bias` and the depth
slope λ = `slope` (either None), each query reading only keys from the position `lower [B, n]`
(int64, its document's first: spec §7) on, or every key when `lower` is None; differentiable
w.r.t. q, k, v and the biases. The bounds are a tensor input like the start, so a document mask
keeps one graph for every block. Its backward adds
the groups' key and value gradients into `grad_hist_k, grad_hist_v` (shaped like the buffers).
`anchor` is taken only so that autograd orders that backward before the anchor's producer's
(history.py). Float32 or float64 (the fused kernels' dtypes). Registered on import (`select.py`
imports this module).

(No `from __future__ import annotations` here: `custom_op` infers the schemas from the
annotations.)
"""

from typing import Any

import torch
from torch import Tensor

from megabeta.kernels.ops import anchor_gradient, custom_op
from megabeta.model.attention.backend import DocumentBounds, GroupBatch, group_runs
from megabeta.model.attention.merged import (
    CPU_FUSED,
    CellStacks,
    cells_backward,
    cells_forward,
    one_cell,
)


def _batches(hist_k: Tensor, hist_v: Tensor, grad_k: Tensor | None, grad_v: Tensor | None,
             start: Tensor, sources: list[int], layer: int, window: int) -> list[GroupBatch]:
    """The groups the block at `start` reads, as views of the buffers (and of the gradient
    buffers, when given)."""
    first = int(start)
    if first == 0:
        return []
    batches = []
    for layers, rows, offsets in group_runs(sources, layer, window, first):
        grads = None
        if grad_k is not None:
            grads = (lambda layers=layers, rows=rows:
                     (grad_k[layers, :, :, rows], grad_v[layers, :, :, rows]))
        batches.append(GroupBatch(hist_k[layers, :, :, rows], hist_v[layers, :, :, rows],
                                  offsets, grads, first=rows.start))
    return batches


def _stacks(batches: list[GroupBatch], slope: Tensor | None, q: Tensor, start: Tensor,
            lower: Tensor | None) -> CellStacks:
    """The one cell's stacks, with its document bounds (if any) at the block's start."""
    documents = None if lower is None else [DocumentBounds(lower, int(start))]
    return CellStacks.of([batches], one_cell(slope), q, documents)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


@custom_op("merged_attention")
def _attention_op(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
                  grad_hist_k: Tensor, grad_hist_v: Tensor, start: Tensor, lower: Tensor | None,
                  self_bias: Tensor | None, slope: Tensor | None, anchor: Tensor | None,
                  sources: list[int], layer: int, window: int,
                  scale: float) -> tuple[Tensor, Tensor]:
    batches = _batches(hist_k, hist_v, None, None, start, sources, layer, window)
    groups = _stacks(batches, slope, q, start, lower)
    out, lse, _ = cells_forward(q[None], k[None], v[None], self_bias, one_cell(slope), groups,
                                scale=scale, kernels=CPU_FUSED)
    # The layouts the fake implementation promises (ATen's CPU flash kernel makes these
    # already: out `[B, n, H, d]` storage, lse `[B, n, H]`).
    return _heads_last(out[0]), lse[0].contiguous()


def _heads_last(x: Tensor) -> Tensor:
    """`x [B, H, n, d]` as a transposed view of a contiguous `[B, n, H, d]` (copied if not)."""
    return x if x.transpose(1, 2).is_contiguous() else x.transpose(1, 2).contiguous().transpose(1, 2)


def _heads_last_like(q: Tensor) -> Tensor:
    batch, heads, n, width = q.shape
    return q.new_empty(batch, n, heads, width).transpose(1, 2)


@_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor, grad_hist_k: Tensor,
      grad_hist_v: Tensor, start: Tensor, lower: Tensor | None, self_bias: Tensor | None,
      slope: Tensor | None, anchor: Tensor | None, sources: list[int], layer: int, window: int,
      scale: float) -> tuple[Tensor, Tensor]:
    return _heads_last_like(q), q.new_empty(q.shape[:3])


@custom_op("merged_attention_backward", mutates_args=("grad_hist_k", "grad_hist_v"))
def _backward_op(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
                 out: Tensor, lse: Tensor, start: Tensor, lower: Tensor | None,
                 self_bias: Tensor | None, slope: Tensor | None, grad_hist_k: Tensor,
                 grad_hist_v: Tensor, sources: list[int], layer: int, window: int,
                 scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    batches = _batches(hist_k, hist_v, grad_hist_k, grad_hist_v, start, sources, layer, window)
    # The fused kernels keep nothing from the forward (`kept` is empty).
    dq, dk, dv, d_bias, d_slope = cells_backward(
        grad[None], q[None], k[None], v[None], out[None], lse[None], self_bias,
        one_cell(slope), [], _stacks(batches, slope, q, start, lower), scale=scale,
        kernels=CPU_FUSED, bias_grad=self_bias is not None)
    if slope is not None:  # no group shifted by a non-zero offset: no gradient
        d_slope = torch.zeros_like(slope) if d_slope is None else d_slope[0]
    return (_like(dq[0], q), _like(dk[0], k), _like(dv[0], v),
            _empty(q) if d_bias is None else d_bias, _empty(q) if d_slope is None else d_slope)


def _like(grad: Tensor, x: Tensor) -> Tensor:
    """`grad` in `x`'s strides (`torch.empty_like(x)`'s, what the fake implementation says)."""
    return grad if grad.stride() == x.stride() else torch.empty_like(x).copy_(grad)


@_backward_op.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
      out: Tensor, lse: Tensor, start: Tensor, lower: Tensor | None, self_bias: Tensor | None,
      slope: Tensor | None, grad_hist_k: Tensor, grad_hist_v: Tensor, sources: list[int],
      layer: int, window: int, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            _empty(q) if self_bias is None else torch.empty_like(self_bias),
            _empty(q) if slope is None else torch.empty_like(slope))


def _setup_context(ctx: Any, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    (q, k, v, hist_k, hist_v, grad_hist_k, grad_hist_v, start, lower, self_bias, slope, _anchor,
     sources, layer, window, scale) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, start, lower, self_bias, slope, out, lse)
    # Held, not saved (as the Triton operator's): later blocks write rows >= start of the
    # history, which this call never reads, and this very backward writes the gradient buffers.
    ctx.history = (hist_k, hist_v, grad_hist_k, grad_hist_v)
    ctx.args = (list(sources), layer, window, scale)
    ctx.anchor = None if _anchor is None else (_anchor.dtype, _anchor.device)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad: Tensor | None, _grad_lse: Tensor | None) -> tuple:
    if grad is None:  # the output took no part in the loss
        return (None,) * 16
    q, k, v, start, lower, self_bias, slope, out, lse = ctx.saved_tensors
    hist_k, hist_v, grad_hist_k, grad_hist_v = ctx.history
    dq, dk, dv, d_bias, d_slope = torch.ops.megabeta.merged_attention_backward(
        grad, q, k, v, hist_k, hist_v, out, lse, start, lower, self_bias, slope, grad_hist_k,
        grad_hist_v, *ctx.args)
    return (dq, dk, dv, None, None, None, None, None, None,
            None if self_bias is None else d_bias, None if slope is None else d_slope,
            anchor_gradient(ctx.anchor), None, None, None, None)


_attention_op.register_autograd(_backward, setup_context=_setup_context)

