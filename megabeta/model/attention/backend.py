"""The attention interface: what a stack of query cells attends to, and the protocol every
attention implementation follows.

A cell is one block's n queries at one layer l (spec §3). They attend, in ONE softmax, to

1. the finished groups: per source layer m ∈ M(l), the finished K/V of the tokens before the
   block (the last w of them for m > l under a deep-token window), their scores minus
   λ_{l,h}·(m - l);
2. the cell's own construction K/V: the earlier tokens of its block (causal) and, on the
   diagonal, the self slot (score plus b_σ).

A wave of the plan (model/plan.py) is a stack of such cells on consecutive blocks at layers
stepping down by the period; a block of the block schedule, a layer of a control arm and a
decoding step are stacks of one. Everything a stack reads is a `Reads`: its layers, the history
(`HistoryView`: the buffers of every source layer and the NEWEST cell's first position, a 0-d
tensor) and the queries' document bounds (spec §7). Own keys may be longer than the queries
(decoding continues a partly filled block): query r is then own key `nk - nq + r`.

Which implementation computes it is chosen once per model (`select.select_attention`) and held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from megabeta.kernels.history_attention import Cells, group_rows
from megabeta.model.history import History, HistoryView


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared by it and read where a setting needs it: by the one
    chooser (`select.select_attention`) and by the executor (model/executor.py)."""

    devices: frozenset[str] | None
    """Device types its kernels run on (None: any)."""
    dropout: bool
    """Attention dropout."""
    traced: bool
    """Runs inside a torch.compile'd unit, reading the history at a start held in a tensor
    (`execution.compile`)."""
    captured: bool
    """Runs inside a CUDA-graph capture: no host read of a device value (`execution.cuda_graphs`)."""
    bias_rows: bool = False
    """Leaves the biases' gradients as per-row sums in the pass's buffers (`BiasRows`), reduced
    once per pass, rather than returning them per call."""


@dataclass(frozen=True)
class KeyLayout:
    """How a backend stores keys and values: `head_dim` features, in the dtypes its kernels
    take."""

    head_dim: int
    dtypes: frozenset[torch.dtype] | None = None
    """The dtypes its history buffers can have (None: any); others are stored as float32."""
    deferred: bool = False
    """Whether the history's gradients are formed once per row (`history_gradients`), stored
    in the history's dtype, rather than added into by every reader (in float32)."""

    def stored_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The history buffers' dtype for finished KVs computed in `dtype`."""
        return dtype if self.dtypes is None or dtype in self.dtypes else torch.float32

    def gradient_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The gradient buffers' dtype for a history of `dtype`."""
        return dtype if self.deferred else torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class Biases:
    """The learned score biases of a stack's n cells (spec §3), oldest cell first: views of the
    pass's stacks of every layer's biases (reverse layer order, like the weights), read without
    a copy. The control arms have none (`NO_BIASES`)."""

    self_bias: Tensor | None = None
    """b_σ per cell `[n]`; None: the self slot has no bias."""
    shift: Tensor | None = None
    """`[n, G, H]`: λ_h·(m - l) per source group of each cell's layer, subtracted from that
    group's scores (G the most groups a layer reads; entries past a cell's groups unused);
    None: no groups."""
    rows: "BiasRows | None" = None
    """The pass's buffers for the biases' per-row gradient sums, this stack's cells as a view;
    None: the gradients go back through autograd."""


NO_BIASES = Biases()


@dataclass(eq=False)
class BiasRows:
    """Per-row partial sums of one pass's bias gradients, every layer's, for kernels that leave
    them per cell (`shift [L, G, B, H, T]` of the depth shift's groups, `diag [L, B, H, T]` of
    the self slot) instead of reducing per cell: the pass reduces them once (`gradients`).
    Layers in reverse order, like the weight stacks: a wave's cells are one strided view."""

    shift: Tensor
    diag: Tensor

    @staticmethod
    def zeros(layers: int, groups: int, batch: int, heads: int, length: int,
              like: Tensor) -> "BiasRows":
        # Zeros: rows that no kernel writes (a block with no history) must add nothing.
        return BiasRows(like.new_zeros(layers, groups, batch, heads, length, dtype=torch.float32),
                        like.new_zeros(layers, batch, heads, length, dtype=torch.float32))

    def cells(self, stack: slice) -> "BiasRows":
        return BiasRows(self.shift[stack], self.diag[stack])

    def gradients(self) -> tuple[Tensor, Tensor]:
        """The shift's gradient `[L, G, H]` (it is subtracted from the scores: minus the row sums)
        and b_σ's `[L]`."""
        return -self.shift.sum((-3, -1)), self.diag.sum((-3, -2, -1))


@dataclass(frozen=True)
class Reads:
    """What a stack of n cells reads besides its own keys."""

    layers: tuple[int, ...]
    """Each cell's layer, oldest cell first (a constant step)."""
    history: HistoryView | None = None
    """The finished K/V of earlier blocks, at the NEWEST cell's start (cell i starts
    (n-1-i)·c rows before it); None: no cell reads any (one block, a control arm)."""
    lower: Tensor | None = None
    """`[n, B, c]` int64: each query's document bound (spec §7: it reads keys at positions
    >= its bound); None: no mask."""

    def starts(self, n: int) -> list[int]:
        """Each cell's first position (host values; `history` given)."""
        last = int(self.history.start)
        count = len(self.layers)
        return [last - (count - 1 - i) * n for i in range(count)]


class AttentionBackend(Protocol):
    """One implementation of the cells' softmax."""

    name: str
    """Its `execution.attention` name."""
    capabilities: Capabilities
    layout: KeyLayout
    """How keys and values are stored for it (history buffers, decode caches)."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, reads: Reads, biases: Biases, *,
               dropout_p: float) -> Tensor:
        """Outputs `[n, B, c, H, d_h]` (heads last, as the output projection reads them) of the
        queries `q [n, B, H, c, d_h]` over their own keys `k, v [n, B, H_kv, nk, d_h]`
        (nk >= c) and what `reads` names, with `biases`. Gradients of the history's rows are
        added into its gradient buffers (or deferred: `history_gradients`)."""

    def prepare(self, history: History, heads: int) -> None:
        """Give a pass's `history` (with gradient buffers: a backward will run) the state its
        readers fill in backward (`History.state`), for queries of `heads` heads."""

    def history_gradients(self, history: History, cells: list[tuple[int, int]], n: int) -> None:
        """Complete the history's gradient rows of `cells` ((block start, layer), n rows each)
        once every reader of them ran backward: a backend whose readers add them at once does
        nothing."""


def per_query_head(x: Tensor, heads: int) -> Tensor:
    """KV heads `[…, H_kv, …]` (dim -3) repeated for the query heads they serve (GQA); as is
    without GQA."""
    kv = x.shape[-3]
    return x if kv == heads else x.repeat_interleave(heads // kv, dim=-3)


def cells_of(reads: Reads) -> Cells:
    """The geometry of `reads`' cells (no groups without a history)."""
    layers = list(reads.layers)
    if reads.history is None:
        return Cells.of([], layers, layers[0])
    history = reads.history
    return Cells.of(history.sources(layers[-1]), layers, history.top)


__all__ = ["AttentionBackend", "BiasRows", "Biases", "Capabilities", "KeyLayout", "NO_BIASES",
           "Reads", "cells_of", "group_rows", "per_query_head"]
