"""`cpu_fused`'s merged attention as the "cpu_fused" implementation of
`megabeta::history_attention` (`megabeta/kernels/history_attention.py`): what the static block
step (beta12.py, `compiled_step`) calls on CPU.

The eager block loop hands `merged.merged_cells` its groups as views sliced at a Python int
(`history.HistoryView.batches`), which a traced graph would bake in: one graph per block. The
operator takes the whole buffers `[L, B, H_kv, T, d_h]` and the block's first position as a 0-d
tensor, and this implementation slices inside, where no tracer looks, so every block of a
sequence has the same graph, as with the Triton kernels. The gradient protocol (the gradient
buffers held and added to in backward, not saved; the anchor; lse not differentiable) is the
operator's, written once for both. The work itself is `merged.cells_forward` / `cells_backward`
(one cell, on `CPU_FUSED`), with the groups' score shifts given as a table (`shift [1, G', H]`,
`CellStacks.of(shift=...)`) rather than λ and the depth offsets: the backward returns the
table's gradient (the groups' row sums of their score gradients, negated), and λ's comes
through autograd from `PassBiases.shift` (beta12.py). The forward and the history's gradients
are computed as on the eager path (`PassBiases.shift` is λ·(m - l) in the merge's precision);
λ's gradient sums the same terms in another order.

One cell (`layers` of length 1), no bias row buffers (`shift_rows`, `diag_rows`), float32 or
float64 (the fused kernels' dtypes); the document bounds `lower [1, B, n]` are read as the eager
path reads them (spec §7). Registered on import (`select.py` imports this module).
"""

from __future__ import annotations

from torch import Tensor

from megabeta.kernels import finished_groups, history_attention
from megabeta.kernels.history_attention import gradient_like
from megabeta.model.attention.backend import DocumentBounds, GroupBatch, group_runs
from megabeta.model.attention.merged import CPU_FUSED, CellStacks, cells_backward, cells_forward


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


def _stacks(batches: list[GroupBatch], shift: Tensor, q: Tensor, start: Tensor,
            lower: Tensor | None) -> CellStacks:
    """The one cell's stacks, shifted by `shift [1, G', H]`, with its document bounds
    `lower [1, B, n]` (if any) at the block's start."""
    documents = None if lower is None else [DocumentBounds(lower[0], int(start))]
    return CellStacks.of([batches], None, q, documents, shift=shift)


def _layer(q: Tensor, layers: list[int], rows: Tensor | None = None) -> int:
    """The one cell's layer, after checking what this implementation supports."""
    if len(layers) != 1:
        raise ValueError(f"history attention 'cpu_fused': one cell only, got layers {layers}")
    if rows is not None:
        raise ValueError("history attention 'cpu_fused': no bias row buffers (shift_rows, "
                         "diag_rows): it returns the biases' gradients")
    if not finished_groups.supports(q.dtype):
        raise ValueError(f"history attention 'cpu_fused': the fused kernels take "
                         f"{' or '.join(map(str, finished_groups.DTYPES))}, not {q.dtype}")
    return layers[0]


def _forward(q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor, start: Tensor,
             shift: Tensor, self_bias: Tensor | None, lower: Tensor | None, sources: list[int],
             layers: list[int], top: int, window: int, scale: float) -> tuple[Tensor, Tensor]:
    layer = _layer(q, layers)
    batches = _batches(hist_k, hist_v, None, None, start, sources, layer, window)
    out, lse, _ = cells_forward(q, k, v, self_bias, None, _stacks(batches, shift, q, start, lower),
                                scale=scale, kernels=CPU_FUSED)
    # The layouts the operator's fake implementation promises (ATen's CPU flash kernel makes
    # these already: out `[B, n, H, d]` storage, lse `[B, H, n]`).
    return _heads_last(out), lse.contiguous()


def _heads_last(x: Tensor) -> Tensor:
    """`x [cells, B, H, n, d]` as a transposed view of a contiguous `[cells, B, n, H, d]`
    (copied if not)."""
    if x.transpose(2, 3).is_contiguous():
        return x
    return x.transpose(2, 3).contiguous().transpose(2, 3)


def _backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, hist_k: Tensor, hist_v: Tensor,
              out: Tensor, lse: Tensor, start: Tensor, shift: Tensor, self_bias: Tensor | None,
              lower: Tensor | None, grad_hist_k: Tensor, grad_hist_v: Tensor,
              sources: list[int], layers: list[int], top: int, window: int, scale: float,
              shift_rows: Tensor | None, diag_rows: Tensor | None
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    layer = _layer(q, layers, shift_rows if shift_rows is not None else diag_rows)
    batches = _batches(hist_k, hist_v, grad_hist_k, grad_hist_v, start, sources, layer, window)
    # The fused kernels keep nothing from the forward (`kept` is empty).
    dq, dk, dv, d_self_bias, d_shift = cells_backward(
        grad, q, k, v, out, lse, self_bias, None, [], _stacks(batches, shift, q, start, lower),
        scale=scale, kernels=CPU_FUSED, bias_grad=self_bias is not None)
    if d_shift is None:  # no group read (the first block): the shift took no part
        d_shift = lse.new_zeros(shift.shape)
    return (_laid_out(dq, q), _laid_out(dk, k), _laid_out(dv, v), d_shift,
            lse.new_empty(1, 0) if d_self_bias is None else d_self_bias.to(lse.dtype))


def _laid_out(grad: Tensor, x: Tensor) -> Tensor:
    """`grad` in `gradient_like(x)`'s strides (what the fake implementation says)."""
    like = gradient_like(x)
    return grad if grad.stride() == like.stride() else like.copy_(grad)


history_attention.register("cpu_fused", forward=_forward, backward=_backward)
