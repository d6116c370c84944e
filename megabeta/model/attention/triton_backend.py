"""`triton`: a stack of cells' whole key set in fused Triton kernels, one launch forward and one
backward per call (`megabeta/kernels/triton_attention.py`).

The kernels read what spec §3 gives the queries of a cell straight from the history buffers:
their own keys (causal, b_σ on the diagonal) and, for every source m ∈ M(l), rows [lo, start)
of layer m's finished keys (the deep-token window's rows for a deeper source), the depth bias
λ_h·(m - l) subtracted from that group's scores; one online softmax over all of it. The cells
of a wave, on consecutive blocks at layers stepping down by the period, are one call: each
cell's start, layer and source layers derived in the kernel from the newest cell's.

The buffers are the whole sequence's (`[L, B, H_kv, T, d_h]`) and the newest cell's start is
read from a device tensor, so every block launches the same shapes: nothing depends on the
block index but the tensors' contents (what `torch.compile` and CUDA graphs need). Document
masks (spec §7) are read per query row from the bounds tensor.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megabeta.kernels import history_attention, triton_attention
from megabeta.model.attention.backend import Biases, Capabilities, KeyLayout, Reads, cells_of
from megabeta.model.history import History


class TritonAttention:
    """The `triton` backend."""

    name = "triton"
    # CUDA (or a CPU under Triton's interpreter: select.py asks elementwise.require_triton).
    capabilities = Capabilities(devices=frozenset({"cuda", "cpu"}), dropout=False, traced=True,
                                captured=True, bias_rows=True)

    def __init__(self, head_dim: int) -> None:
        # The history's gradients are stored once per row (`history_gradients`): in its dtype.
        self.layout = KeyLayout(head_dim, deferred=True)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, reads: Reads, biases: Biases, *,
               dropout_p: float) -> Tensor:
        if dropout_p:
            raise ValueError("triton attention has no dropout (select the reference backend)")
        view = reads.history
        cells = cells_of(reads)
        dtype = q.dtype if view is None else view.dtype
        state: list[Tensor] = []
        if view is None:
            hist_k = hist_v = q.new_empty(0, dtype=dtype)
            start = torch.zeros((), dtype=torch.int64, device=q.device)
            sources: list[int] = []
        else:
            hist_k, hist_v, start = view.keys, view.values, view.start
            sources = view.sources(reads.layers[-1])
            if torch.is_grad_enabled():
                state = list(view.state)
        shift = biases.shift if biases.shift is not None else q.new_zeros(
            cells.count, 1, q.shape[2], dtype=torch.float32)
        rows = {}
        if biases.rows is not None and torch.is_grad_enabled():
            rows = dict(shift_rows=biases.rows.shift, diag_rows=biases.rows.diag)
        out = history_attention.attention(
            q.to(dtype), k.to(dtype), v.to(dtype), hist_k, hist_v, start, shift,
            biases.self_bias, state=state, sources=sources, layers=list(reads.layers),
            top=cells.top, window=0 if view is None else view.window,
            scale=1.0 / math.sqrt(q.shape[-1]), implementation="triton", lower=reads.lower,
            **rows)
        return out.transpose(2, 3)

    def prepare(self, history: History, heads: int) -> None:
        """The pass's reader buffers (`triton_attention.readers`): each reader's backward
        leaves its queries, output gradients and lse there."""
        groups = max(map(len, history.sources))
        history.state = tuple(triton_attention.readers(history.keys, heads, groups))

    def history_gradients(self, history: History, cells: list[tuple[int, int]], n: int) -> None:
        """Each published row's key and value gradients, formed once over every query that
        read it (`triton_attention.history_gradients`), from the pass's reader buffers."""
        depth, stride = _depth_and_stride(history.sources)
        triton_attention.history_gradients(
            history.keys, history.values, history.grad_keys, history.grad_values,
            list(history.state), history.documents, cells=cells, block=n, depth=depth,
            stride=stride, window=history.window,
            scale=1.0 / math.sqrt(history.keys.shape[-1]))


def _depth_and_stride(sources: list[list[int]]) -> tuple[int, int]:
    """The depth window and stride that give each layer l its source layers M(l) (spec §3):
    m ∈ M(l) iff l ≤ m ≤ l + depth and m - l is a multiple of the stride."""
    stride = next((s[1] - s[0] for s in sources if len(s) > 1), 1)
    depth = max(s[-1] - l for l, s in enumerate(sources))
    return depth, stride
