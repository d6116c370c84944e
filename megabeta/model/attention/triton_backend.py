"""`triton`: a block's whole key set in one fused Triton kernel per (block, layer).

The kernel (`megabeta/kernels/triton_attention.py`) reads what spec §3 gives the queries of block
b at layer l straight from the history buffers: the block's own keys (causal, b_σ on the
diagonal) and, for every source m ∈ M(l), rows [lo, start) of layer m's finished keys (the
deep-token window's rows for a deeper source), with the depth bias λ_h·(m - l) subtracted from
that group's scores; one online softmax over all of it. Its backward adds the groups' key and
value gradients into the history's gradient buffers in place.

The buffers are the whole sequence's (`[L, B, H_kv, T, d_h]`) and the block's start is read from
a device tensor, so every block launches the same shapes: nothing here depends on the block
index but the tensors' contents (what `torch.compile` and CUDA graphs need).

Decoding and the explicit reference hand attention the history as pieces; those calls go to the
merged path of the device (`merged.py`: ATen's CUDA or CPU kernels), which computes the same
function.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megabeta.kernels import triton_attention
from megabeta.model.attention.backend import (
    AttentionBackend,
    AttentionBias,
    CellByCell,
    KeyLayout,
    KeySet,
    after_backward,
)


class TritonAttention(CellByCell):
    """The `triton` backend; `pieces` serves the calls that come with the history as pieces."""

    name = "triton"
    reads_buffers = True

    def __init__(self, head_dim: int, pieces: AttentionBackend) -> None:
        self.layout = KeyLayout(head_dim)
        self.pieces = pieces

    def attend(self, q: Tensor, keys: KeySet, bias: AttentionBias, *, layer: int,
               dropout_p: float) -> Tensor:
        if dropout_p:
            raise ValueError("triton attention has no dropout (select the sdpa backend)")
        stored = keys.stored
        if stored is None and (keys.finished or keys.history_pieces()[0]):
            return self.pieces.attend(q, keys, bias, layer=layer, dropout_p=dropout_p)
        scale = 1.0 / math.sqrt(q.shape[-1])
        if stored is None:
            # A block with no history (the first, or a sequence of at most c tokens): own keys.
            empty = q.new_empty(0)
            return triton_attention.block_attention(
                q, keys.k.to(q.dtype), keys.v.to(q.dtype), empty, empty, empty, empty,
                q.new_zeros((), dtype=torch.int64), q.new_empty(0, q.shape[1]), bias.self_bias,
                sources=[], layer=layer, window=0, scale=scale, **_rows(bias, q))
        # In the buffers' dtype: the kernels take one, and autocast does not reach them.
        dtype = stored.dtype
        sources = stored.sources(layer)
        hist_k, hist_v = stored.buffers()
        grad_k, grad_v = (stored.gradient_buffers() if torch.is_grad_enabled()
                          else (hist_k.new_empty(0), hist_k.new_empty(0)))
        q = after_backward(q.to(dtype), stored.done_reading)
        return triton_attention.block_attention(
            q, keys.k.to(dtype), keys.v.to(dtype), hist_k, hist_v, grad_k, grad_v,
            stored.start_index(), bias.group_shift, bias.self_bias, sources=sources, layer=layer,
            window=stored.window, scale=scale, anchor=stored.anchor,
            **_rows(bias, q))


def _rows(bias: AttentionBias, q: Tensor) -> dict[str, Tensor]:
    """The pass's buffers for the biases' gradient rows (`BiasRows`), when training (beta12
    builds them with the group shifts)."""
    if bias.rows is None or not torch.is_grad_enabled():
        return {}
    shift, diag = bias.rows.buffers(bias.group_shift.shape[0], q.shape[0], q.shape[1], q)
    return dict(shift_rows=shift, diag_rows=diag)

