"""`explicit`: spec §3's softmax written out (score matrix, bias, softmax, weighted sum).

The readable reference among the backends: slow and memory-hungry (the whole score matrix per
block), exact, any device, attention dropout included. The history comes as pieces.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from megabeta.model.attention.backend import (
    AttentionBias,
    Capabilities,
    CellByCell,
    KeyLayout,
    KeySet,
    per_query_head,
)


class ExplicitAttention(CellByCell):
    name = "explicit"
    reads_buffers = False
    capabilities = Capabilities(devices=None, dropout=True, static_step=False,
                                batched_waves=False, documents=True)

    def __init__(self, head_dim: int) -> None:
        self.layout = KeyLayout(head_dim)

    def attend(self, q: Tensor, keys: KeySet, bias: AttentionBias, *, layer: int,
               dropout_p: float) -> Tensor:
        if keys.stored is not None:
            raise ValueError("explicit attention reads the history as pieces, not buffers")
        heads, n, head_dim = q.shape[1], q.shape[2], q.shape[3]
        hist_k, hist_v, offsets = keys.history_pieces()
        k = per_query_head(torch.cat([*hist_k, keys.k], dim=2), heads)
        v = per_query_head(torch.cat([*hist_v, keys.v], dim=2), heads)

        # Bias columns: one constant per history piece and head, then the in-block square.
        columns = []
        for offset, piece in zip(offsets, hist_k):
            col = q.new_zeros(heads, 1, piece.shape[2])
            if bias.slope is not None and offset:
                col = col - (bias.slope * offset).view(heads, 1, 1)
            columns.append(col.expand(heads, n, piece.shape[2]))
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        square = q.new_zeros(n, n).masked_fill(~allowed, float("-inf"))
        if bias.self_bias is not None:
            square = square + torch.eye(n, dtype=q.dtype, device=q.device) * bias.self_bias
        columns.append(square.expand(heads, n, n))

        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim) + torch.cat(columns, dim=2)
        if keys.documents is not None:
            scores = scores.masked_fill(~keys.documents.allowed(_positions(keys, n)),
                                        float("-inf"))
        probs = F.dropout(torch.softmax(scores, dim=-1), p=dropout_p)
        return probs @ v


def _positions(keys: KeySet, n: int) -> Tensor:
    """The position of every key in the order `attend` concatenates them (history pieces,
    then the queries' own keys)."""
    if keys.prefix_k is not None and keys.prefix_k.shape[2] > 0:
        raise ValueError("a document mask with a decoding prefix: a cache holds one document")
    device = keys.k.device
    pieces = [torch.arange(first, first + k.shape[2], device=device)
              for first, (_, k, _) in zip(keys.finished_first, keys.finished)]
    return torch.cat([*pieces, keys.documents.own_positions(n)])
