"""`reference`: spec §3's softmax written out, cell by cell (score matrix, bias, mask, softmax,
weighted sum).

The readable backend: every key of a query's key set listed in one score matrix with its bias,
one plain softmax, float64-exact, any device, attention dropout included. Slow and
memory-hungry (the whole score matrix of a cell). The history's groups are read as views of its
buffers; their gradients are added into its gradient buffers by `_HistoryRead` in backward.
`KeySet` is what one cell's queries read, laid out in that order: the dials (train/dials.py)
read the same key sets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from megabeta.model.attention.backend import (
    Biases,
    Capabilities,
    KeyLayout,
    Reads,
    group_rows,
    per_query_head,
)
from megabeta.model.history import History


@dataclass
class KeySet:
    """One cell's keys in score order: its finished groups' rows, then its own keys."""

    keys: Tensor
    """`[B, H_kv, S, d_h]`."""
    values: Tensor
    bias: Tensor
    """`[H, c, S]`: each score's bias (depth shift, self slot; -inf where causality hides a
    key)."""
    positions: Tensor
    """`[S]`: each key's token position (spec §7's bounds compare them)."""
    groups: list[tuple[str, int, int]]
    """(kind, depth offset m - l, count) runs along S: the "finished" groups, then "own"."""


def key_set(q: Tensor, k: Tensor, v: Tensor, reads: Reads, biases: Biases, cell: int,
            start: int) -> KeySet:
    """The key set of cell `cell` (queries `q [B, H, c, d_h]`, own keys `k, v [B, H_kv, nk,
    d_h]`) whose block starts at `start`."""
    heads, c, nk = q.shape[1], q.shape[2], k.shape[2]
    layer = reads.layers[cell]
    keys, values, biases_, positions, groups = [], [], [], [], []
    view = reads.history
    if view is not None and start > 0:
        grads = view.gradient_buffers()
        for g, m in enumerate(view.sources(layer)):
            rows = group_rows(view.window, layer, m, start)
            if rows.stop <= rows.start:
                continue
            hk, hv = view.keys[m, :, :, rows], view.values[m, :, :, rows]
            if grads is not None and torch.is_grad_enabled() and q.requires_grad:
                hk, hv = _HistoryRead.apply(q, hk, hv, grads[0][m, :, :, rows],
                                            grads[1][m, :, :, rows])
            keys.append(hk.to(q.dtype))
            values.append(hv.to(q.dtype))
            shift = q.new_zeros(heads) if biases.shift is None else -biases.shift[cell, g]
            biases_.append(shift.to(q.dtype)[:, None, None].expand(heads, c, hk.shape[2]))
            positions.append(torch.arange(rows.start, rows.stop, device=q.device))
            groups.append(("finished", m - layer, hk.shape[2]))
    # Own keys: the block's tokens from its start; query r is own key nk - c + r.
    row = torch.arange(c, device=q.device)[:, None] + (nk - c)
    column = torch.arange(nk, device=q.device)[None, :]
    own = torch.zeros(c, nk, dtype=q.dtype, device=q.device).masked_fill(column > row,
                                                                          float("-inf"))
    if biases.self_bias is not None:
        own = own + (column == row).to(q.dtype) * biases.self_bias[cell].to(q.dtype)
    keys.append(k)
    values.append(v)
    biases_.append(own.expand(heads, c, nk))
    positions.append(torch.arange(start, start + nk, device=q.device))
    groups.append(("own", 0, nk))
    return KeySet(torch.cat(keys, 2), torch.cat(values, 2), torch.cat(biases_, 2),
                  torch.cat(positions), groups)


def scores(q: Tensor, keys: KeySet, lower: Tensor | None) -> Tensor:
    """The biased, scaled scores `[B, H, c, S]` of queries `q [B, H, c, d_h]` over `keys`, -inf
    where a key is hidden (causality; spec §7: before the query's document, `lower [B, c]`)."""
    heads = q.shape[1]
    s = q @ per_query_head(keys.keys, heads).transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s + keys.bias
    if lower is not None:
        hidden = keys.positions[None, None, None, :] < lower[:, None, :, None]
        s = s.masked_fill(hidden, float("-inf"))
    return s


class ReferenceAttention:
    """The `reference` backend."""

    name = "reference"
    capabilities = Capabilities(devices=None, dropout=True, traced=False, captured=False)

    def __init__(self, head_dim: int) -> None:
        self.layout = KeyLayout(head_dim)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, reads: Reads, biases: Biases, *,
               dropout_p: float) -> Tensor:
        c = q.shape[3]
        starts = reads.starts(c) if reads.history is not None else [0] * len(reads.layers)
        outs = []
        for i, start in enumerate(starts):
            keys = key_set(q[i], k[i], v[i], reads, biases, i, start)
            s = scores(q[i], keys, None if reads.lower is None else reads.lower[i])
            p = F.dropout(torch.softmax(s, dim=-1), p=dropout_p)
            outs.append((p @ per_query_head(keys.values, q.shape[2])).transpose(1, 2))
        return torch.stack(outs)

    def prepare(self, history: History, heads: int) -> None:
        """Nothing to keep: `_HistoryRead` adds into the gradient buffers themselves."""

    def history_gradients(self, history: History, cells: list[tuple[int, int]], n: int) -> None:
        """Nothing to finish: `_HistoryRead` adds each reader's share in its backward."""


class _HistoryRead(torch.autograd.Function):
    """Forward: a group's keys and values (views of the history's buffers) as they are.
    Backward: their gradients added into the history's gradient buffers (history.py). `anchor`
    (the queries) is an input only so that the outputs take part in autograd."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, k: Tensor, v: Tensor, grad_k: Tensor,
                grad_v: Tensor) -> tuple[Tensor, Tensor]:
        ctx.grads = (grad_k, grad_v)
        ctx.set_materialize_grads(False)
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx: Any, dk: Tensor | None, dv: Tensor | None) -> tuple[None, ...]:
        grad_k, grad_v = ctx.grads
        if dk is not None:
            grad_k.add_(dk)
        if dv is not None:
            grad_v.add_(dv)
        return None, None, None, None, None
