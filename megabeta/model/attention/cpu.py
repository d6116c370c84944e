"""`cpu`: the whole key set of a stack of cells (spec §3, §7) on the fused C++ kernels
(`megabeta/kernels/cpu_attention.cpp`): one online softmax per query tile over the cells' own
keys (causal, b_σ on the diagonal) and their finished groups (rows of the history's buffers,
each shifted by its depth bias), forward and backward; the groups' key and value gradients are
added straight into the history's gradient buffers.

It calls the "cpu" implementation of `megabeta::history_attention`
(`megabeta/kernels/cpu_attention.py`; the operator and its one gradient registration:
`megabeta/kernels/history_attention.py`), so a compiled unit traces it as one opaque call. The
kernels take float32 and float64: under bf16 autocast the history is stored as float32 and the
queries computed in it (`KeyLayout`), the output returned in the queries' dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megabeta.kernels import cpu_attention, history_attention
from megabeta.model.attention.backend import Biases, Capabilities, KeyLayout, Reads, cells_of
from megabeta.model.history import History


class CpuAttention:
    """The `cpu` backend."""

    name = "cpu"
    capabilities = Capabilities(devices=frozenset({"cpu"}), dropout=False, traced=True,
                                captured=False)

    def __init__(self, head_dim: int) -> None:
        self.layout = KeyLayout(head_dim, dtypes=frozenset(cpu_attention.DTYPES))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, reads: Reads, biases: Biases, *,
               dropout_p: float) -> Tensor:
        if dropout_p:
            raise ValueError("cpu attention has no dropout (select the reference backend)")
        view = reads.history
        dtype = view.dtype if view is not None else self.layout.stored_dtype(q.dtype)
        cells = cells_of(reads)
        empty = q.new_empty(0, dtype=dtype)
        state: list[Tensor] = []
        if view is None:
            hist_k = hist_v = empty
            start = torch.zeros((), dtype=torch.int64)
        else:
            hist_k, hist_v, start = view.keys, view.values, view.start
            state = list(view.state) if torch.is_grad_enabled() else []
        shift = biases.shift if biases.shift is not None else q.new_zeros(
            cells.count, 1, q.shape[2], dtype=history_attention.lse_dtype(dtype))
        out = history_attention.attention(
            q.to(dtype), k.to(dtype), v.to(dtype), hist_k, hist_v, start, shift,
            biases.self_bias, state=state, sources=[] if view is None else view.sources(reads.layers[-1]),
            layers=list(reads.layers), top=cells.top, window=0 if view is None else view.window,
            scale=1.0 / math.sqrt(q.shape[-1]), implementation="cpu", lower=reads.lower)
        return out.transpose(2, 3).to(q.dtype)

    def prepare(self, history: History, heads: int) -> None:
        """The readers add their groups' gradients into the history's gradient buffers."""
        history.state = (history.grad_keys, history.grad_values)

    def history_gradients(self, history: History, cells: list[tuple[int, int]], n: int) -> None:
        """Nothing to finish: the backward adds each reader's share at once."""
